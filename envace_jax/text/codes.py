"""The integer codes a trajectory carries: a `Role` per token and a `Status` per row.

Defined once, here at the bottom of the layers, because the text layer tags tokens with roles,
the sampler writes both codes inside its compiled loop, the trajectory batch stores them, and
the losses, rollouts and metrics read them. Names in metrics are the members' lower-case names.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """Who wrote a token."""

    CONTEXT = 0  # Prompt, chat-template glue, real-environment or user text: never trained.
    ACT = 1  # The agent's own messages.
    REHEARSE = 2  # The policy's rehearsal of an environment response.

    @property
    def label(self) -> str:
        """The lower-case name configs and metrics use ('act', 'rehearse')."""
        return self.name.lower()

    @classmethod
    def generated(cls) -> tuple[Role, ...]:
        """The roles the policy generates (the trainable ones)."""
        return (cls.ACT, cls.REHEARSE)


class Status(enum.IntEnum):
    """Where a trajectory stands: RUNNING / AWAITING_ENV while the sampler holds it, then why it
    stopped."""

    RUNNING = 0
    FINISHED = 1  # a final reply with no user turn left (or the end of a plain generation)
    TRUNCATED = 2  # token budget or per-message length exhausted
    TURN_LIMIT = 3  # the ACT role called tools in its last allowed message
    INVALID = 4  # an abort token, or (set on the host) an unparseable action
    AWAITING_ENV = 5  # host-turn mode: waiting for the environment's observation

    @property
    def label(self) -> str:
        """The lower-case name metrics use ('finished', 'turn_limit', ...)."""
        return self.name.lower()

    @classmethod
    def stopped(cls) -> tuple[Status, ...]:
        """The codes a stored trajectory can have, in the order metrics list them."""
        return (cls.FINISHED, cls.TRUNCATED, cls.TURN_LIMIT, cls.INVALID)

    def settled(self) -> Status:
        """The stored code of a row the sampler returned with this code: a row still running or
        awaiting the environment ran out of decode steps, i.e. it is TRUNCATED."""
        return Status.TRUNCATED if self in (Status.RUNNING, Status.AWAITING_ENV) else self
