"""The pure-functional sampler: the compiled decode loop and its row states (`loop`,
`loop_state`, `transitions`), sampling distributions, chat-layout specs (`chat_spec`) and the
`Sampler` that drives the loop over given parameters."""
