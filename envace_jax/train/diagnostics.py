"""Held-out teacher-forced diagnostics of a policy on oracle demonstrations.

Real-environment success needs the policy to copy ids and amounts exactly from its context
(the request, the records table, earlier tool results). A small policy trained from scratch
learns the format of its messages long before it learns to copy, and then every call fails
while its training loss looks fine. `copy_metrics` makes that visible during the warm start:
on demonstrations of held-out tasks, how often the policy's most likely next token is the
demonstrated one — over all ACT tokens, and over the ACT tokens that are digits (the ids'
and amounts' digits, which can only be copied).

The same score on REHEARSE digits says whether the rehearser reads the world: a tool
response's ids, prices and balances come from the records table (or follow from it), so a
rehearser that guesses them makes rehearsed rewards say little about real success. Scored per
tool as well, it tells a lookup that is not read (`find_customer`, `list_orders`) from a
result that is not worked out (`cancel_order`, `refund` and `transfer` state the balance after
the change, a sum or a difference of two numbers in the context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envace_jax.rl.batch import smallest_fitting_bucket
from envace_jax.text.codes import Role


@dataclasses.dataclass(frozen=True)
class CopyProbe:
    """A padded batch of demonstrations with the positions that are scored."""

    tokens: np.ndarray  # [B, T] int32, right-padded
    act: np.ndarray  # [B, T] bool: ACT tokens (targets)
    digits: np.ndarray  # [B, T] bool: ACT tokens that are digits
    rehearse_digits: np.ndarray  # [B, T] bool: REHEARSE tokens that are digits
    # [B, T] int: index into `tools` of the call whose response a REHEARSE token belongs to
    # (-1 elsewhere, or everywhere when the probe was built without tool names).
    response_tool: np.ndarray
    tools: tuple[str, ...]


def build_copy_probe(
    examples: Sequence,
    tokenizer,
    pad_id: int,
    length: int,
    response_tools: Sequence[Sequence[str]] | None = None,
) -> CopyProbe:
    """`examples`: encoded conversations (`.ids`, `.roles`, `.segments`), cut to `length`
    tokens. `response_tools[b]`, if given, names the tool of each REHEARSE segment of example
    b in order (the tool messages of its conversation), for per-tool REHEARSE scores."""
    if not examples:
        raise ValueError("build_copy_probe: no examples")
    if response_tools is not None and len(response_tools) != len(examples):
        raise ValueError(
            f"build_copy_probe: {len(response_tools)} response_tools lists for "
            f"{len(examples)} examples"
        )
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    is_digit = np.array([p.isdigit() for p in pieces] + [False])  # ids past the vocab: False
    tools = tuple(sorted({name for names in response_tools or () for name in names}))
    tokens = np.full((len(examples), length), pad_id, np.int32)
    act = np.zeros((len(examples), length), bool)
    rehearse = np.zeros((len(examples), length), bool)
    response_tool = np.full((len(examples), length), -1, np.int32)
    for b, ex in enumerate(examples):
        n = min(len(ex.ids), length)
        tokens[b, :n] = ex.ids[:n]
        act[b, :n] = np.asarray(ex.roles[:n]) == Role.ACT
        rehearse[b, :n] = np.asarray(ex.roles[:n]) == Role.REHEARSE
        if response_tools is None:
            continue
        segs = [s for s, r in enumerate(ex.segment_roles(), 1) if r == Role.REHEARSE]
        if len(segs) != len(response_tools[b]):
            raise ValueError(
                f"build_copy_probe: example {b} has {len(segs)} REHEARSE segments but "
                f"response_tools[{b}] names {len(response_tools[b])} tools"
            )
        for s, name in zip(segs, response_tools[b], strict=True):
            response_tool[b, :n][np.asarray(ex.segments[:n]) == s] = tools.index(name)
    act[:, 0] = rehearse[:, 0] = False  # nothing predicts the first token
    digit = is_digit[np.minimum(tokens, len(is_digit) - 1)]
    return CopyProbe(tokens, act, act & digit, rehearse & digit, response_tool, tools)


@nnx.jit
def _argmax_tokens(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = model(tokens, positions)
    return jnp.argmax(logits, axis=-1)


def copy_metrics(model: nnx.Module, probe: CopyProbe) -> dict[str, float]:
    """{'heldout/act_token_acc', 'heldout/act_digit_acc', 'heldout/rehearse_digit_acc'}:
    teacher-forced greedy accuracy; with a probe built with tool names, also
    'heldout/rehearse_digit_acc/<tool>' for each tool whose responses hold a scored digit."""
    pred = np.asarray(jax.device_get(_argmax_tokens(model, jnp.asarray(probe.tokens))))
    hit = pred[:, :-1] == probe.tokens[:, 1:]  # prediction at t is for token t + 1
    out = {}
    scored = (
        ("act_token_acc", probe.act),
        ("act_digit_acc", probe.digits),
        ("rehearse_digit_acc", probe.rehearse_digits),
    )
    for name, mask in scored:
        m = mask[:, 1:]
        out[f"heldout/{name}"] = float(hit[m].mean()) if m.any() else 0.0
    for t, tool in enumerate(probe.tools):
        m = (probe.rehearse_digits & (probe.response_tool == t))[:, 1:]
        if m.any():
            out[f"heldout/rehearse_digit_acc/{tool}"] = float(hit[m].mean())
    return out


def held_out_probe(domain, tasks: Sequence, tokenizer, buckets: Sequence[int]) -> CopyProbe:
    """The copy probe of `tasks`' demonstrations in `domain`, padded to the smallest length
    bucket that holds them, with each response's tool named."""
    examples = domain.demonstrations(tasks, tokenizer)
    length = smallest_fitting_bucket(max(len(e.ids) for e in examples), buckets)
    tools = domain.response_tools(tasks)
    return build_copy_probe(examples, tokenizer, tokenizer.pad_token_id, length, tools)
