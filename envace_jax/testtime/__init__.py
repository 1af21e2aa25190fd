"""Test-time rehearsal: private rehearsals in parallel or in sequence (`rehearsal`), the memory
they are summarised into and the warm start's memory demonstrations (`memory`,
`demonstrations`), and the `rehearsal_eval` job that scores it against committed execution."""
