"""The memory slot (text.memory_slot): the empty slot at each place, filling it, slotted tasks
and domains, and prompts with a filled slot rendered to the chat template's own token ids."""

import types

import pytest

from envace_jax.configuration import ConfigError, load, validate
from envace_jax.envs.demo import DemoEnv, generate_tasks
from envace_jax.envs.registry import domain
from envace_jax.testtime import memory as mem
from envace_jax.testtime.demonstrations import exact_memory
from envace_jax.testtime.rehearsal import TestTimeRehearsal
from envace_jax.text import memory_slot as ms
from envace_jax.text.role_pieces import prompt_ids
from envace_jax.text.tokenizer import load_tokenizer
from tests.conftest import demo_config

EMPTY = "Rehearsal memory: none"  # the documented text of the empty slot
SYSTEM = {"role": "system", "content": "Shop assistant."}
USER = {"role": "user", "content": "Cancel order O3."}
MEMORY = "Rehearsal memory (from private rehearsals, not real):\n" + (
    'plan (1 of 1 rehearsals):\n1. f {"x": "Zoë"}'
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def _appended(message, text):
    return {**message, "content": f"{message['content']}\n\n{text}"}


def test_with_slot_puts_the_empty_slot_at_each_place():
    assert ms.EMPTY == EMPTY and ms.PLACES == ("off", "system", "user")
    chat = [SYSTEM, USER]
    assert ms.with_slot(chat, "off") == chat
    assert ms.with_slot(chat, "system") == [_appended(SYSTEM, EMPTY), USER]
    assert ms.with_slot(chat, "user") == [SYSTEM, _appended(USER, EMPTY)]
    # A chat without a system message gets one that holds the slot alone.
    assert ms.with_slot([USER], "system") == [{"role": "system", "content": EMPTY}, USER]
    assert ms.with_slot([USER], "user") == [_appended(USER, EMPTY)]
    # The input is not mutated.
    assert chat == [SYSTEM, USER] and SYSTEM["content"] == "Shop assistant."
    with pytest.raises(ValueError, match="'middle'"):
        ms.with_slot(chat, "middle")


def test_fill_replaces_exactly_the_slot_and_appends_without_one():
    chat = [SYSTEM, USER]
    slotted = {p: ms.with_slot(chat, p) for p in ("system", "user")}
    assert ms.fill(slotted["system"], MEMORY) == [_appended(SYSTEM, MEMORY), USER]
    assert ms.fill(slotted["user"], MEMORY) == [SYSTEM, _appended(USER, MEMORY)]
    assert slotted["user"][-1]["content"].endswith(EMPTY)  # the slotted chat is not mutated
    inserted = ms.with_slot([USER], "system")
    assert ms.fill(inserted, MEMORY) == [{"role": "system", "content": MEMORY}, USER]
    # No slot: the memory is appended to the last message (the instruction).
    assert ms.fill(chat, MEMORY) == [SYSTEM, _appended(USER, MEMORY)]
    # The slot's text inside a paragraph, not as the last one, is no slot.
    quoting = [SYSTEM, {"role": "user", "content": f"I read '{EMPTY}'. Cancel O3."}]
    assert ms.fill(quoting, MEMORY) == [SYSTEM, _appended(quoting[1], MEMORY)]
    # An empty memory leaves the messages, and their empty slot, as they are (as copies).
    for messages in (chat, *slotted.values()):
        for memory in ("", None):
            out = ms.fill(messages, memory)
            assert out == messages
            assert all(a is not b for a, b in zip(out, messages, strict=True))
    # insert_memory is the slot's fill.
    assert mem.insert_memory(slotted["system"], MEMORY) == [_appended(SYSTEM, MEMORY), USER]


def test_slotted_task_slots_the_opening_and_keeps_the_later_reference_messages():
    task = next(t for t in generate_tasks(7, 20, "train") if t.ground_truth["n_calls"] >= 2)
    n = len(task.messages)
    assert len(task.reference_messages) > n + 2  # calls, responses, reply follow the opening
    assert ms.slotted_task(task, "off") is task
    for place, index in (("system", 0), ("user", n - 1)):
        out = ms.slotted_task(task, place)
        expected = [dict(m) for m in task.messages]
        expected[index] = _appended(expected[index], EMPTY)
        assert isinstance(out.messages, tuple) and isinstance(out.reference_messages, tuple)
        assert list(out.messages) == expected
        assert list(out.reference_messages[:n]) == expected
        assert out.reference_messages[n:] == task.reference_messages[n:]
        assert (out.tools, out.ground_truth, out.checklist) == (
            task.tools,
            task.ground_truth,
            task.checklist,
        )
    assert EMPTY not in str(task.messages) + str(task.reference_messages)  # not mutated
    with pytest.raises(ValueError, match="'middle'"):
        ms.slotted_task(task, "middle")


def test_domains_slot_every_task_when_the_knob_asks():
    config = demo_config("smoke")
    assert load(config).data.memory_slot == "off"
    plain = generate_tasks(config.seed, 6, "train")
    assert domain("demo", load(config).data).generate_tasks(config.seed, 6, "train") == plain
    config.data.memory_slot = "system"
    data = load(config).data
    found = domain("demo", data)
    for split in ("train", "validation"):
        tasks = found.generate_tasks(config.seed, 6, split)
        for got, task in zip(tasks, generate_tasks(config.seed, 6, split), strict=True):
            assert got.messages[0]["content"] == f"{task.messages[0]['content']}\n\n{EMPTY}"
            assert got.messages[1:] == task.messages[1:]
            assert got.reference_messages[0] == got.messages[0]
    held_out = found.held_out_tasks(load(config))
    assert all(t.messages[0]["content"].endswith(f"\n\n{EMPTY}") for t in held_out)
    config.data.memory_slot = "middle"
    with pytest.raises(ConfigError, match=r"config\.data\.memory_slot = 'middle'"):
        validate(config)


def _template_ids(tok, messages, tools):
    out = tok.apply_chat_template(
        [dict(m) for m in messages], tools=tools, add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("place", ["system", "user"])
def test_a_filled_slot_renders_to_the_chat_templates_ids(tok, place):
    """The sampler's prompt path (`prompt_ids`, and the committed run's `prompt`) gives the ids
    the tokenizer's own chat template gives, with the memory as the slot's paragraph."""
    tasks = generate_tasks(3, 6, "test") + generate_tasks(3, 3, "test", tools_in_system=False)
    assert any(t.template_tools for t in tasks) and not all(t.template_tools for t in tasks)
    committed = types.SimpleNamespace(tokenizer=tok)  # what `TestTimeRehearsal.prompt` reads
    for task in tasks:
        slotted = ms.slotted_task(task, place)
        for memory in ("", MEMORY, exact_memory(slotted, DemoEnv)):
            messages = mem.insert_memory(slotted.messages, memory)
            ids = _template_ids(tok, messages, slotted.template_tools)
            assert prompt_ids(tok, messages, slotted.template_tools) == ids
            assert TestTimeRehearsal.prompt(committed, slotted, memory) == ids
            # The memory (or the empty slot) ends the content of the slot's turn; a system
            # turn's tools block, where the template renders one, follows it.
            text = tok.decode(ids)
            start = text.index(f"<|im_start|>{place}\n")
            body = text[start : text.index("<|im_end|>", start)]
            shown = f"\n\n{memory or EMPTY}"
            assert text.count(shown) == body.count(shown) == 1
            after = body[body.index(shown) + len(shown) :]
            assert after == "" or (place == "system" and after.startswith("\n\n# Tools"))
            assert (EMPTY in text) == (not memory)
