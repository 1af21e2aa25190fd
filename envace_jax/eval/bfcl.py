"""BFCL-v4 with the official `bfcl-eval` package, against our OpenAI-compatible server.

    python -m envace_jax.eval.bfcl --model DIR [--categories offline] [--limit N] [--out DIR]
    python -m envace_jax.eval.bfcl --gold-check [--categories ...] [--limit N] [--out DIR]

`bfcl-eval` lives in a virtual environment of its own (`envs.bfcl_package`), created on first
use under `.cache/bfcl-venv` (or `$ENVACE_CACHE/bfcl-venv`) and reused afterwards. Its data
(questions, possible answers, multi-turn function docs, memory prerequisites) ships in the
wheel: nothing is downloaded at run time.

How our policy plugs in: the package's local-model path (`--skip-server-setup
--local-model-path DIR`) renders each prompt itself with the Qwen3 function-calling format
(`QwenFCHandler`) and calls `/v1/completions` with the raw text; replies are parsed from
`<tool_call>` blocks. We register the model id `envace-jax-FC` with that handler (as the
package's own contributors add models), start `python -m envace_jax.serve` on a free loopback
port, run `bfcl generate` (each reply capped at `--max-tokens`, 1,024 by default) then `bfcl
evaluate`, and collect the official score files
(`score/envace-jax-FC/**/BFCL_v4_*_score.json` and `score/data_*.csv`) into `summary.json`.

Categories that run offline: the AST categories (non-live and live, irrelevance, relevance),
the four multi-turn categories, and memory with the `kv` and `rec_sum` backends. Web search
needs the internet (SerpAPI) and memory_vector downloads an embedding model from the Hugging
Face hub, so neither runs here; the summary says so and gives, next to the official overall
(which counts every category not run as 0), the overall recomputed with the official weights
over the categories that can run offline, clearly labelled. A partial run (`--limit`, or some
categories) prints no overall at all.

`--limit N` runs the first N entries of each category (with the memory prerequisite
conversations they depend on), evaluated with `--partial-eval`. `--gold-check` writes the
ground-truth answers as result files in our model's output format (`<tool_call>` blocks built
by `text.tool_calls.format_tool_calls`) and runs the official checker on them: every category
must score 100%, which proves the result plumbing and the call format end to end.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from envace_jax.envs.bfcl_multi_turn.env import WORKER as BFCL_WORLD
from envace_jax.envs.bfcl_package import BFCL_VERSION, default_venv, ensure_venv, venv_environ
from envace_jax.eval.bfcl_scores import (
    DISPLAY_NAME,
    LIVE,
    MEMORY_OFFLINE,
    MODEL_ID,
    MULTI_TURN,
    NON_LIVE,
    NOT_OFFLINE,
    OFFLINE,
    summarize,
    summary_lines,
)
from envace_jax.eval.serving import start_server, stop_server

GROUPS = {
    "offline": OFFLINE,
    "non_live": NON_LIVE,
    "live": LIVE,
    "multi_turn": MULTI_TURN,
    "memory": MEMORY_OFFLINE,
}


# Registers our model id with the package's Qwen3 function-calling handler, then runs its CLI.
# Written to a file (not `python -c`) so multiprocessing children re-import the registration.
def capped(create, cap: int):
    """`create` (the OpenAI client's `completions.create`) with `max_tokens` at most `cap`.
    bfcl-eval asks for what the context leaves (up to 4,096 tokens), and one runaway reply
    then decodes for minutes on a CPU."""

    def create_capped(*args, **kwargs):
        kwargs["max_tokens"] = min(kwargs.get("max_tokens") or cap, cap)
        return create(*args, **kwargs)

    return create_capped


MAX_TOKENS_ENV = "ENVACE_BFCL_MAX_TOKENS"
_LAUNCHER = f"""
import os
import sys
from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler

{inspect.getsource(capped)}

class CappedQwenFCHandler(QwenFCHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cap = os.environ.get({MAX_TOKENS_ENV!r})  # set for `generate` only
        if cap:
            self.client.completions.create = capped(self.client.completions.create, int(cap))


MODEL_CONFIG_MAPPING[{MODEL_ID!r}] = ModelConfig(
    model_name="envace-jax",
    display_name={DISPLAY_NAME!r},
    url="",
    org="envace_jax",
    license="",
    model_handler=CappedQwenFCHandler,
    input_price=None,
    output_price=None,
    is_fc_model=True,
    underscore_to_dot=False,
)

if __name__ == "__main__":
    from bfcl_eval.__main__ import cli

    sys.argv = ["bfcl", *sys.argv[1:]]
    cli()
"""


def log(msg: str) -> None:
    print(f"[bfcl] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Running the package


def resolve_categories(names: list[str]) -> list[str]:
    """Category names or group names -> categories, refusing ones that cannot run offline."""
    out: list[str] = []
    for name in names:
        if name in NOT_OFFLINE:
            raise SystemExit(f"category {name!r} cannot run offline: {NOT_OFFLINE[name]}")
        items = GROUPS.get(name, [name])
        for item in items:
            if item not in OFFLINE:
                raise SystemExit(f"unknown BFCL category {item!r}; offline ones: {OFFLINE}")
            if item not in out:
                out.append(item)
    return out


def _run_in_venv(python: Path, root: Path, args: list[str], log_name: str, env=None, timeout=None):
    log_path = root / log_name
    start = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.run(
            [str(python), *args],
            cwd=root,
            env=venv_environ(root, env),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if proc.returncode != 0:
        tail = "".join(open(log_path).readlines()[-40:])
        raise RuntimeError(f"{log_name[:-4]} failed ({proc.returncode}); {log_path}:\n{tail}")
    log(f"{log_name[:-4]} done in {time.perf_counter() - start:.0f}s (log: {log_path})")


_SELECT = """
import json, sys
from bfcl_eval.utils import load_dataset_entry
categories, limit = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for cat in categories:
    entries = load_dataset_entry(cat)
    by_id = {e["id"]: e for e in entries}
    main = [e for e in entries if "prereq" not in e["id"]]
    chosen = main if limit is None else main[:limit]
    ids, todo = [], [e["id"] for e in chosen]
    while todo:  # the entries chosen and, transitively, the prerequisites they depend on
        i = todo.pop()
        if i not in ids:
            ids.append(i)
            todo.extend(by_id[i].get("depends_on", []))
    out[cat] = sorted(ids)
json.dump(out, open("test_case_ids_to_generate.json", "w"), indent=1)
print(sum(len(v) for v in out.values()))
"""


def select_entries(python: Path, root: Path, categories: list[str], limit: int | None) -> dict:
    """Writes the package's `test_case_ids_to_generate.json` (used by `--run-ids`)."""
    _run_in_venv(
        python, root, ["-c", _SELECT, json.dumps(categories), json.dumps(limit)], "select.log"
    )
    return json.loads((root / "test_case_ids_to_generate.json").read_text())


def generate(python, root, model_dir, base_url, api_key, threads, timeout, max_tokens):
    host_port = base_url.split("://", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    env = {"LOCAL_SERVER_ENDPOINT": host, "LOCAL_SERVER_PORT": port}
    env[MAX_TOKENS_ENV] = str(max_tokens)
    if api_key:
        env["REMOTE_OPENAI_API_KEY"] = api_key
    args = ["launch_bfcl.py", "generate", "--model", MODEL_ID, "--run-ids"]
    args += ["--skip-server-setup", "--local-model-path", str(model_dir)]
    args += ["--num-threads", str(threads), "--allow-overwrite"]
    _run_in_venv(python, root, args, "generate.log", env=env, timeout=timeout)


def evaluate(python, root, categories, partial, timeout):
    args = ["launch_bfcl.py", "evaluate", "--model", MODEL_ID]
    args += ["--test-category", ",".join(categories)]
    if partial:
        args.append("--partial-eval")
    _run_in_venv(python, root, args, "evaluate.log", timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Gold check


def write_gold_results(python: Path, root: Path, ids: dict[str, list[str]]) -> int:
    """Result files holding the ground truth in our model's output format (see bfcl_gold)."""
    from envace_jax.eval import bfcl_gold

    (root / "extract_gold.py").write_text(bfcl_gold.EXTRACT)
    (root / "gold_ids.json").write_text(json.dumps(ids))
    args = ["extract_gold.py", "gold_ids.json", "gold.json", str(BFCL_WORLD)]
    _run_in_venv(python, root, args, "gold.log")
    extracted = json.loads((root / "gold.json").read_text())
    return bfcl_gold.write_results(extracted, root / "result" / MODEL_ID)


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m envace_jax.eval.bfcl", description=__doc__)
    p.add_argument("--model", help="HF model directory to serve (with its tokenizer)")
    p.add_argument("--base-url", help="use a running server instead (its --model is still read)")
    p.add_argument("--api-key", default=os.environ.get("ENVACE_API_KEY"))
    p.add_argument("--categories", default="offline", help="comma list of categories / groups")
    p.add_argument("--limit", type=int, default=None, help="first N entries per category")
    p.add_argument("--out", default="bfcl_out", help="project root for results and scores")
    p.add_argument("--venv", default=None, help="bfcl-eval virtual environment")
    p.add_argument("--threads", type=int, default=16, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=1024, help="cap on one reply's tokens")
    p.add_argument("--timeout", type=float, default=None, help="seconds per bfcl command")
    p.add_argument("--gold-check", action="store_true", help="score the ground truth instead")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    return p.parse_args(argv)


def run(args) -> dict:
    categories = resolve_categories([c for c in args.categories.split(",") if c])
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for old in ("result", "score"):  # a run's scores must be its own
        subprocess.run(["rm", "-rf", str(root / old)], check=True)
    python = ensure_venv(Path(args.venv) if args.venv else default_venv())
    (root / "launch_bfcl.py").write_text(_LAUNCHER)
    ids = select_entries(python, root, categories, args.limit)
    log(f"{sum(map(len, ids.values()))} entries in {len(categories)} categories")
    if args.gold_check:
        write_gold_results(python, root, ids)
    else:
        if not args.model:
            raise SystemExit("--model DIR is required (the tokenizer is read from it)")
        model_dir = Path(args.model).resolve()
        proc, url = (
            (None, args.base_url)
            if args.base_url
            else start_server(str(model_dir), root, args.server_arg)
        )
        try:
            generate(
                python,
                root,
                model_dir,
                url,
                args.api_key,
                args.threads,
                args.timeout,
                args.max_tokens,
            )
        finally:
            if proc is not None:
                stop_server(proc)
    evaluate(python, root, categories, args.limit is not None, args.timeout)
    label = "gold answers through the official checker" if args.gold_check else "model"
    summary = summarize(root, categories, args.limit, label)
    summary["bfcl_eval_version"] = BFCL_VERSION
    summary["max_tokens"] = None if args.gold_check else args.max_tokens
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"summary: {root / 'summary.json'}")
    return summary


def main(argv=None) -> int:
    print("\n".join(summary_lines(run(parse_args(argv)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
