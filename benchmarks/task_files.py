"""Host memory and time of reading a reference-sized task file: `open_tasks` (records validated
in one streaming pass, kept as compressed JSON, parsed on access) against the baseline of
holding every task as Python objects (`load_tasks`).

The file is the size of the reference's training parquet (about 7.5k tasks in about 100 MB,
about 56 KB of JSON per task): synthetic but valid reference-layout records, each with a long
system prompt, a dozen tools, three user turns of tool calls with long tool responses and a
checklist per turn, written by `envace_jax.data.export`. Each measurement runs in a fresh
subprocess and reports its RSS growth (now, and the peak from getrusage) over the RSS after
imports. The bar: `open_tasks` grows RSS by under 1 GB.

    python benchmarks/task_files.py --json task_files.json
    python benchmarks/task_files.py --tasks 200 --mb 3 --json tiny.json   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import machine

MEASURE = r"""
import json, resource, sys, time
import psutil
import pyarrow.parquet  # imported by the first read: not part of the growth
from etils import epath
from envace_jax.data.readers import load_tasks
from envace_jax.data.sources import open_tasks
proc = psutil.Process()
def rss(): return proc.memory_info().rss
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
path, mode = sys.argv[1], sys.argv[2]
base, base_peak = rss(), peak()
t = time.perf_counter()
if mode == "open_tasks":
    source = open_tasks(path)
else:
    source = load_tasks(path).tasks
opened = time.perf_counter() - t
after_open, peak_open = rss(), peak()
t = time.perf_counter()
n = chars = 0
for task in source:
    n += 1
    chars += len(task.reference_messages[-1]["content"])
read = time.perf_counter() - t
out = {
    "tasks": n,
    "open_s": opened,
    "read_all_s": read,
    "rss_growth_open": after_open - base,
    "peak_growth_open": max(0, peak_open - base),
    "rss_growth_after_read": rss() - base,
    "peak_growth": max(0, peak() - base),
}
if mode == "open_tasks":
    out["stored_bytes"] = source.stored_bytes
print(json.dumps(out))
"""


def _words(rng: random.Random, vocab: list[str], n: int) -> str:
    return " ".join(rng.choices(vocab, k=n))


def synthetic_task(i: int, chars: int, vocab: list[str]):
    """A valid multi-turn task of about `chars` characters of JSON (our layout), as a Task."""
    from envace_jax.data.checklists import FOCUS_ON_VALUES
    from envace_jax.data.tasks import Task

    rng = random.Random(i)
    w = max(chars // 7, 400)  # words of text in all, about 7 characters each with the space
    n_tools, turns, calls = 12, 3, 3
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}_{k}",
                "description": _words(rng, vocab, w // 60),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg_{a}": {"type": "string", "description": _words(rng, vocab, 8)}
                        for a in range(3)
                    },
                    "required": ["arg_0"],
                },
            },
        }
        for k in range(n_tools)
    ]
    system = {"role": "system", "content": _words(rng, vocab, w // 12)}
    conv = [system]
    checklist = []
    for turn in range(turns):
        conv.append({"role": "user", "content": f"task {i} turn {turn}: " + _words(rng, vocab, 40)})
        for c in range(calls):
            name = tools[rng.randrange(n_tools)]["function"]["name"]
            cid = f"call_{turn}_{c}"
            args = {"arg_0": _words(rng, vocab, 3)}
            conv.append(
                {
                    "role": "assistant",
                    "content": "<think>" + _words(rng, vocab, 30) + "</think>",
                    "tool_calls": [
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)},
                        }
                    ],
                }
            )
            body = json.dumps({"result": _words(rng, vocab, w // 20)})
            conv.append({"role": "tool", "tool_call_id": cid, "name": name, "content": body})
        conv.append({"role": "assistant", "content": _words(rng, vocab, 60)})
        items = [
            {
                "question": _words(rng, vocab, 15) + "?",
                "focus_on": FOCUS_ON_VALUES[k % 2 * 2],
                "pass_condition": _words(rng, vocab, 25),
                "failure_examples": [_words(rng, vocab, 8), _words(rng, vocab, 8)],
                "evidence": [{"turn": turn, "step": 1, "snippet": _words(rng, vocab, 10)}],
                "weight": 0.25,
                "required_for_next_turn": k == 0,
            }
            for k in range(4)
        ]
        checklist.append(items)
    return Task.from_dict(
        {
            "task_id": f"synthetic-{i:06d}",
            "messages": conv[:2],
            "tools": tools,
            "reference_messages": conv,
            "checklist": checklist,
            "metadata": {"data_source": "synthetic"},
        }
    )


def make_file(path: str, tasks: int, mb: float) -> dict:
    """Write `tasks` synthetic tasks, sized so the parquet is about `mb` MB; returns figures."""
    from envace_jax.data.export import export_tasks

    vrng = random.Random(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(vrng.choices(letters, k=vrng.randint(3, 9))) for _ in range(5000)]
    # These records compress about 2.4 to 1 in the exported parquet: size the tasks from the
    # target.
    chars = int(mb * 1e6 / tasks * 2.4)
    chars = chars * chars // len(synthetic_task(0, chars, vocab).to_json())  # one correction
    t = time.perf_counter()
    n = export_tasks((synthetic_task(i, chars, vocab) for i in range(tasks)), path)
    return {
        "tasks": n,
        "file_bytes": os.path.getsize(path),
        "json_chars_per_task": len(synthetic_task(0, chars, vocab).to_json()),
        "write_s": time.perf_counter() - t,
    }


def measure(path: str, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, path, mode], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=7500, help="tasks in the file")
    parser.add_argument("--mb", type=float, default=100, help="target parquet size in MB")
    parser.add_argument("--file", help="measure this task file instead of writing one")
    parser.add_argument("--no-baseline", action="store_true", help="skip load_tasks")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    figures: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = args.file or os.path.join(d, "tasks.parquet")
        if not args.file:
            figures["file"] = make_file(path, args.tasks, args.mb)
            f = figures["file"]
            print(
                f"wrote {f['tasks']} tasks, {f['file_bytes'] / 1e6:.1f} MB parquet "
                f"({f['json_chars_per_task'] / 1e3:.0f} KB of JSON per task) in {f['write_s']:.0f}s"
            )
        modes = ["open_tasks"] + ([] if args.no_baseline else ["load_tasks"])
        for mode in modes:
            r = figures[mode] = measure(path, mode)
            extra = f", {r['stored_bytes'] / 1e6:.0f} MB stored" if "stored_bytes" in r else ""
            print(
                f"{mode}: {r['tasks']} tasks; open {r['open_s']:.1f}s, RSS +"
                f"{r['rss_growth_open'] / 2**20:.0f} MiB (peak +{r['peak_growth_open'] / 2**20:.0f}"
                f" MiB){extra}; every task read once {r['read_all_s']:.1f}s "
                f"({r['read_all_s'] / max(r['tasks'], 1) * 1e3:.2f} ms each), peak +"
                f"{r['peak_growth'] / 2**20:.0f} MiB"
            )
    ours = figures["open_tasks"]
    figures["under_1gb"] = ours["peak_growth"] < 2**30
    print(f"open_tasks peak RSS growth under 1 GiB: {figures['under_1gb']}")
    if "load_tasks" in figures:
        ratio = figures["load_tasks"]["peak_growth"] / max(ours["peak_growth"], 1)
        figures["baseline_peak_ratio"] = ratio
        print(f"load_tasks' peak RSS growth / open_tasks': {ratio:.1f}x")
    figures["load_average"] = os.getloadavg()
    print("load average " + " ".join(f"{x:.2f}" for x in figures["load_average"]))
    if args.json:
        machine.write_json(args.json, figures, indent=1)


if __name__ == "__main__":
    main()
