"""SIGINT that is always honoured.

Python turns SIGINT into a KeyboardInterrupt in the main thread, wherever it happens to be.
Libraries that catch BaseException swallow it there: Orbax's `wait_until_finished`, joining its
save-finalize thread, logs the exception to the library log and goes on, so a job interrupted at
that moment ran to its end. `install()` makes the handler remember the signal as well, and
`check()` (called by the trainer at every step boundary) raises it again if it was swallowed.
Raised inside a finalizer (JAX's garbage-collection callback, say), the KeyboardInterrupt can
only be reported, with a traceback, as an unraisable exception: such reports are dropped, and
`check()` raises it where it can be handled.
"""

from __future__ import annotations

import signal
import sys

_received = False


def _on_sigint(signum, frame):
    global _received
    _received = True
    raise KeyboardInterrupt


def install() -> None:
    """Replaces the SIGINT handler (main thread only) and drops the unraisable reports of the
    interrupts it raises."""
    global _received
    _received = False
    signal.signal(signal.SIGINT, _on_sigint)
    hook = sys.unraisablehook
    if getattr(hook, "_drops_interrupts", False):
        return

    def unraisable(u):
        if not isinstance(u.exc_value, KeyboardInterrupt):
            hook(u)

    unraisable._drops_interrupts = True
    sys.unraisablehook = unraisable


def received() -> bool:
    """Whether a SIGINT came since `install()` that `check()` has not raised again."""
    return _received


def check() -> None:
    """Raises KeyboardInterrupt if a SIGINT came since `install()` or the last raise (a no-op
    otherwise)."""
    global _received
    if _received:
        _received = False
        raise KeyboardInterrupt
