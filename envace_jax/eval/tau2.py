"""tau2-bench against our server: start it, run the `tau2` CLI with our policy as the agent.

    pip install "tau2 @ git+https://github.com/sierra-research/tau2-bench"   # once; see docs
    python -m envace_jax.eval.tau2 --model DIR --domain airline \\
        --user-llm openai/gpt-4.1 [--num-tasks 5] [--num-trials 1] [-- EXTRA TAU2 ARGS]

tau2 calls models through litellm: our policy is `openai/<served name>` with `api_base`
pointing at the server (litellm's OpenAI-compatible route, which a test exercises with a
multi-turn tool-calling exchange). The user simulator is another LLM — by default an outside
service (set its key, e.g. OPENAI_API_KEY) — so tau2 does not run offline. `--user-llm local`
simulates the user with our own server too (for plumbing checks only: scores are meaningless).
Results are written where tau2 writes them (`--save-to`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from envace_jax.eval import serving

INSTALL = 'pip install "tau2 @ git+https://github.com/sierra-research/tau2-bench"'


def tau2_command(args, base_url: str, extra: list[str]) -> list[str]:
    """The `tau2 run` command line for our server at base_url."""
    agent = f"openai/{serving.served_name(args.model)}"
    llm_args = {"api_base": base_url, "api_key": args.api_key or "EMPTY"}
    llm_args.update(temperature=args.temperature, max_tokens=args.max_tokens)
    user, user_args = args.user_llm, json.loads(args.user_llm_args or "{}")
    if user == "local":
        user, user_args = agent, {**llm_args, **user_args}
    cmd = ["tau2", "run", "--domain", args.domain, "--agent-llm", agent]
    cmd += ["--agent-llm-args", json.dumps(llm_args), "--user-llm", user]
    if user_args:
        cmd += ["--user-llm-args", json.dumps(user_args)]
    cmd += ["--num-trials", str(args.num_trials), "--max-concurrency", str(args.max_concurrency)]
    if args.num_tasks:
        cmd += ["--num-tasks", str(args.num_tasks)]
    if args.save_to:
        cmd += ["--save-to", args.save_to]
    return cmd + extra


def main(argv=None) -> int:
    argv, extra = serving.split_argv(argv)
    p = serving.harness_parser("python -m envace_jax.eval.tau2", __doc__, workdir="tau2_out")
    p.add_argument("--domain", default="airline", help="airline, retail, telecom, ...")
    p.add_argument("--user-llm", required=True, help="litellm model id, or 'local'")
    p.add_argument("--user-llm-args", default=None, help="JSON passed as --user-llm-args")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--save-to", default=None)
    args = p.parse_args(argv)
    if serving.cli_missing("tau2", INSTALL):
        return 2
    with serving.served(args.model, Path(args.workdir), serving.server_flags(args)) as url:
        cmd = tau2_command(args, url, extra)
        print("running: " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
