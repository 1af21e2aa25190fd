"""Test-time rehearsal: N private rehearsals of a task, a rehearsal memory, one committed run.

    ttr = TestTimeRehearsal(model, tokenizer, max_turns=6, max_message_tokens=128)
    rehearsals = ttr.rehearse(rehearser_params, tasks, mode="parallel", n=8, key=key)
    memories = ttr.memories(rehearser_params, tasks, rehearsals, budget=4, key=key)
    results = ttr.commit(executor_params, tasks, memories, DemoEnv, key=key)

Rehearsals are world rehearsals (`sampling.loop` mode 'rehearse'): the policy writes its tool
calls *and* the responses it expects, inside the compiled decode loop. Nothing here takes an
environment except `commit`, so no rehearsal can reach the real one; only the committed run
executes calls (`real_env_rollouts`, host turns).

* **parallel**: the N attempts of every task are rows of one batched sampler call, all from
  the task's plain prompt (independent, i.i.d. given the key).
* **sequential**: N sampler calls; attempt k of a task is conditioned on attempts 1..k-1. With
  the structured memory format they enter the context as their structured memory (the plan
  selected so far and the calls the rehearsals saw refused); with the summary format as their
  transcripts, each followed by its assessment and revision suggestion
  (`memory.render_transcripts`).

After every attempt comes an assessment: the rule assessor (`memory.assess`, no ground truth)
or, with `assessor='policy'`, an assessment the policy writes from a prompt (`ASSESS_SYSTEM`),
kept next to the rule findings (which still rank attempts for the structured memory).

The memory of a budget b uses attempts 1..b (`memories(..., budget=b)`), so one rehearsal with
n attempts serves every budget b <= n: in parallel mode the first b of n i.i.d. attempts are b
i.i.d. attempts, and in sequential mode attempts 1..b are exactly what a run with n = b makes.
The memory fills the committed run's memory slot (`memory.insert_memory`; the format is
documented in `envace_jax.testtime.memory`, the slot in `envace_jax.text.memory_slot`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax.rollout.episodes import build_episodes
from envace_jax.rollout.real_env import RealEpisode, real_env_rollouts
from envace_jax.sampling.chat_spec import later_user_turns, turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.testtime import memory as mem
from envace_jax.text.chat import decode, render
from envace_jax.text.codes import Role
from envace_jax.text.role_pieces import prompt_ids

REHEARSAL_STRATEGIES = ("parallel", "sequential")
ASSESSORS = ("rules", "policy")
ASSESS_SYSTEM = (
    "You check a private rehearsal of a tool-use task. Its tool results were imagined, not "
    "real. Say whether it does the task correctly and what to change."
)
ASSESS_REQUEST = "Write one line 'assessment: ...' and one line 'revision: ...'."
SUMMARY_SYSTEM = (
    "You write a rehearsal memory for an agent's one real attempt at a tool-use task, from "
    "private rehearsals whose tool results were imagined, not real: the plan of tool calls that "
    "should work, the results to expect, and the mistakes to avoid. Be brief."
)
SUMMARY_REQUEST = "Write the rehearsal memory."
SAMPLED, GREEDY = SamplingParams(temperature=1.0), SamplingParams(greedy=True)


@dataclasses.dataclass
class Rehearsal:
    """The private rehearsals of one task, in order: attempts[k] was conditioned on
    contexts[k] (the memory / history block in its prompt; '' for none) and assessed by
    assessments[k]."""

    attempts: list[mem.Attempt] = dataclasses.field(default_factory=list)
    assessments: list[mem.Assessment] = dataclasses.field(default_factory=list)
    contexts: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Committed:
    """Committed executions: one real-environment episode per task, and the prompt ids each
    was decoded from (the memory is inside them)."""

    results: list[RealEpisode]
    prompts: list[list[int]]


class TestTimeRehearsal:
    """Test-time rehearsal for one policy architecture; parameters are passed per call, so the
    rehearser and the executor may be different checkpoints of the same model.

    memory: 'structured' or 'summary' (see `envace_jax.testtime.memory`). assessor: 'rules' or
    'policy'. sampling: how attempts are sampled (assessments and summaries are greedy).
    max_new_tokens: token budget of one attempt. max_memory_tokens: budget of a
    policy-written assessment or summary. commit_rows: committed runs decoded at once (memory
    grows with rows x prompt length, and memory-conditioned prompts are long). min_support:
    the structured memory the committed run reads is ``plan: none`` unless at least this many
    attempts made its plan (`memory.render_memory`); sequential attempts still see every
    earlier attempt.
    """

    __test__ = False  # not a pytest class, despite the name

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_turns: int,
        max_message_tokens: int,
        memory: str = "structured",
        assessor: str = "rules",
        sampling: SamplingParams = SAMPLED,
        max_new_tokens: int = 384,
        max_memory_tokens: int = 160,
        commit_rows: int = 64,
        min_support: int = 1,
    ):
        if commit_rows < 1:
            raise ValueError(f"commit_rows must be >= 1, got {commit_rows}")
        if memory not in mem.FORMATS:
            raise ValueError(f"memory format must be one of {mem.FORMATS}, got {memory!r}")
        if assessor not in ASSESSORS:
            raise ValueError(f"assessor must be one of {ASSESSORS}, got {assessor!r}")
        self.tokenizer = tokenizer
        self.memory, self.assessor, self.sampling = memory, assessor, sampling
        self.max_new_tokens, self.max_memory_tokens = max_new_tokens, max_memory_tokens
        self.commit_rows, self.min_support = commit_rows, min_support
        pad = tokenizer.pad_token_id
        common = dict(max_turns=max_turns, max_message_tokens=max_message_tokens)
        self.rehearse_sampler = Sampler(
            model, turn_spec(tokenizer, mode="rehearse", **common), pad_id=pad
        )
        self.host_sampler = Sampler(model, turn_spec(tokenizer, mode="host", **common), pad_id=pad)
        self.generate_sampler = Sampler(
            model,
            turn_spec(
                tokenizer, mode="generate", max_turns=1, max_message_tokens=max_memory_tokens
            ),
            pad_id=pad,
        )

    # ----------------------------------------------------------------------------- prompts

    def prompt(self, task: Any, memory: str | None) -> list[int]:
        """Prompt ids of `task` with `memory` inserted (the plain prompt when it is empty)."""
        messages = mem.insert_memory(task.messages, memory)
        return prompt_ids(self.tokenizer, messages, task.template_tools)

    def _context(self, rehearsal: Rehearsal) -> str:
        """What the next sequential attempt is conditioned on."""
        if not rehearsal.attempts:
            return ""
        if self.memory == "structured":
            return mem.render_memory(rehearsal.attempts, rehearsal.assessments)
        return f"{mem.HISTORY_HEADER}\n" + mem.render_transcripts(
            rehearsal.attempts, rehearsal.assessments
        )

    # --------------------------------------------------------------------------- attempts

    def _attempts(self, params, tasks: Sequence[Any], contexts: Sequence[str], key) -> list:
        """One world-rehearsal attempt per row (row b: tasks[b] with contexts[b] inserted)."""
        sampler = self.rehearse_sampler.with_params(params)
        prompts = [self.prompt(t, c) for t, c in zip(tasks, contexts, strict=True)]
        users = [later_user_turns(self.tokenizer, t.reference_messages) for t in tasks]
        out = sampler.generate(
            prompts,
            key=key,
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            user_turns=users,
        )
        return [mem.Attempt.from_episode(ep) for ep in build_episodes(self.tokenizer, tasks, out)]

    def _assess(self, params, tasks: Sequence[Any], attempts: Sequence[mem.Attempt], key):
        """Rule assessments of each (task, attempt) row, with the policy's own written
        assessment added when the assessor is 'policy'."""
        rules = [mem.assess(t, a) for t, a in zip(tasks, attempts, strict=True)]
        if self.assessor == "rules":
            return rules
        requests = [
            mem.render_transcripts([a], [mem.Assessment(text=" ")]) + f"\n\n{ASSESS_REQUEST}"
            for a in attempts
        ]
        texts = self._write(params, tasks, ASSESS_SYSTEM, requests, key)
        return [
            dataclasses.replace(r, text=" ".join(t.split("\n")))
            for r, t in zip(rules, texts, strict=True)
        ]

    def rehearse(
        self, params, tasks: Sequence[Any], *, mode: str, n: int, key: jax.Array
    ) -> list[Rehearsal]:
        """`n` private rehearsals of every task (see the module docstring); no environment."""
        if mode not in REHEARSAL_STRATEGIES:
            raise ValueError(f"rehearsal mode must be one of {REHEARSAL_STRATEGIES}, got {mode!r}")
        if n < 1:
            raise ValueError(f"rehearsal budget n must be >= 1, got {n}")
        out = [Rehearsal() for _ in tasks]
        if mode == "parallel":
            rows = [t for t in tasks for _ in range(n)]
            attempts = self._attempts(params, rows, [""] * len(rows), key)
            assessed = self._assess(params, rows, attempts, jax.random.fold_in(key, 1))
            for i, (a, s) in enumerate(zip(attempts, assessed, strict=True)):
                r = out[i // n]
                r.attempts.append(a)
                r.assessments.append(s)
                r.contexts.append("")
            return out
        for k in range(n):
            step_key = jax.random.fold_in(key, k)
            contexts = [self._context(r) for r in out]
            attempts = self._attempts(params, tasks, contexts, step_key)
            assessed = self._assess(params, tasks, attempts, jax.random.fold_in(step_key, 1))
            for r, c, a, s in zip(out, contexts, attempts, assessed, strict=True):
                r.attempts.append(a)
                r.assessments.append(s)
                r.contexts.append(c)
        return out

    # ----------------------------------------------------------------------------- memory

    def memories(
        self,
        params,
        tasks: Sequence[Any],
        rehearsals: Sequence[Rehearsal],
        *,
        budget: int,
        key: jax.Array,
    ) -> list[str]:
        """The memory of every task from its first `budget` attempts ('' when budget is 0).
        params: the policy that writes summaries (format 'summary'); unused otherwise."""
        if budget == 0:
            return [""] * len(tasks)
        for r in rehearsals:
            if len(r.attempts) < budget:
                raise ValueError(f"budget {budget} exceeds the {len(r.attempts)} attempts made")
        if self.memory == "structured":
            return [
                mem.render_memory(
                    r.attempts[:budget], r.assessments[:budget], min_support=self.min_support
                )
                for r in rehearsals
            ]
        requests = [
            mem.render_transcripts(r.attempts[:budget], r.assessments[:budget])
            + f"\n\n{SUMMARY_REQUEST}"
            for r in rehearsals
        ]
        texts = self._write(params, tasks, SUMMARY_SYSTEM, requests, key)
        return [f"{mem.SUMMARY_HEADER}\n{t}" if t else mem.SUMMARY_HEADER for t in texts]

    def _write(self, params, tasks, system: str, requests: Sequence[str], key) -> list[str]:
        """Greedy policy-written text, one per (task, request) row, cleaned for insertion."""
        sampler = self.generate_sampler.with_params(params)
        prompts = []
        for task, request in zip(tasks, requests, strict=True):
            context = "\n\n".join(str(m.get("content") or "") for m in task.messages)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Task:\n{context}\n\n{request}"},
            ]
            prompts.append(render(self.tokenizer, messages, None, add_generation_prompt=True))
        out = sampler.generate(
            prompts,
            key=key,
            sampling=GREEDY,
            max_new_tokens=self.max_memory_tokens,
        )
        texts = []
        for b in range(len(prompts)):
            n = int(out.lengths[b])
            ids = out.tokens[b, :n][out.roles[b, :n] == Role.ACT]
            texts.append(mem.clean_generated(decode(self.tokenizer, ids)))
        return texts

    # ---------------------------------------------------------------------------- commit

    def commit(
        self,
        params,
        tasks: Sequence[Any],
        memories: Sequence[str] | None,
        make_env: Callable[[], Any],
        *,
        key: jax.Array,
        sampling: SamplingParams = GREEDY,
        max_new_tokens: int = 384,
    ) -> Committed:
        """One committed execution of every task in a fresh real environment, its prompt
        carrying the task's memory. Greedy rows with the same (task, memory) are decoded once
        (they are the same run)."""
        memories = list(memories) if memories is not None else [""] * len(tasks)
        if len(memories) != len(tasks):
            raise ValueError(f"{len(memories)} memories for {len(tasks)} tasks")
        prompts = [self.prompt(t, m) for t, m in zip(tasks, memories, strict=True)]
        rows = list(range(len(tasks)))
        if sampling.greedy:
            first: dict[tuple, int] = {}
            for i, t in enumerate(tasks):
                first.setdefault((id(t), tuple(prompts[i])), i)
            rows = sorted(set(first.values()))
            of_row = {i: first[(id(t), tuple(prompts[i]))] for i, t in enumerate(tasks)}
        sampler = self.host_sampler.with_params(params)
        results = []
        for c, start in enumerate(range(0, len(rows), self.commit_rows)):
            chunk = rows[start : start + self.commit_rows]
            results += real_env_rollouts(
                sampler,
                self.tokenizer,
                [tasks[i] for i in chunk],
                make_env,
                key=jax.random.fold_in(key, c) if c else key,
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                prompts=[prompts[i] for i in chunk],
            )[0]
        if sampling.greedy:
            by_row = dict(zip(rows, results, strict=True))
            results = [by_row[of_row[i]] for i in range(len(tasks))]
        return Committed(results, prompts)


def success_rate(committed: Committed) -> float:
    return float(np.mean([r.success for r in committed.results])) if committed.results else 0.0
