"""VitaBench against our server: start it, write the models file, run the `vita` CLI.

    pip install "vita @ git+https://github.com/meituan/vitabench"   # once; see docs
    python -m envace_jax.eval.vitabench --model DIR --models-yaml models.yaml \\
        --user-llm USER --evaluator-llm JUDGE --domain delivery [--num-tasks 5] [-- EXTRA]

VitaBench reads its LLM endpoints from a `models.yaml` (`VITA_MODEL_CONFIG_PATH`). The user
simulator and the evaluator are other LLMs — outside services you configure in your own
`--models-yaml` — so VitaBench does not run offline. We copy that file, add an entry for our
policy (its served name, `base_url` = our server) and run `vita run` with our policy as the
agent. Results are written where vita writes them (data/simulations/).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from envace_jax.eval.serving import served, served_name

INSTALL = 'pip install "vita @ git+https://github.com/meituan/vitabench"'


def models_config(base: dict, name: str, base_url: str, api_key: str | None, max_tokens: int):
    """`base` (the user's models.yaml) with an entry for our policy added or replaced."""
    config = dict(base or {})
    entry = {"name": name, "base_url": base_url, "max_tokens": max_tokens, "temperature": 0.0}
    if api_key:
        entry["headers"] = {"Authorization": f"Bearer {api_key}"}
    models = [m for m in config.get("models") or [] if m.get("name") != name]
    config["models"] = models + [entry]
    return config


def main(argv=None) -> int:
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m envace_jax.eval.vitabench", description=__doc__)
    p.add_argument("--model", required=True, help="HF model directory to serve")
    p.add_argument("--models-yaml", required=True, help="your models.yaml (user, evaluator)")
    p.add_argument("--user-llm", required=True)
    p.add_argument("--evaluator-llm", required=True)
    p.add_argument("--domain", default="delivery", help="delivery, instore, ota or a list")
    p.add_argument("--num-tasks", type=int, default=None)
    p.add_argument("--num-trials", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--language", default="english", choices=("english", "chinese"))
    p.add_argument("--api-key", default=None, help="the server's API key, if it needs one")
    p.add_argument("--workdir", default="vitabench_out")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    args = p.parse_args(argv)
    if shutil.which("vita") is None:
        print(f"the vita CLI is not installed; install it with:\n  {INSTALL}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with open(args.models_yaml, encoding="utf-8") as f:
        base = yaml.safe_load(f) or {}
    server_args = list(args.server_arg)
    if args.api_key:
        server_args += ["--api-key", args.api_key]
    name = served_name(args.model)
    with served(args.model, workdir, server_args) as url:
        config = models_config(base, name, url, args.api_key, args.max_tokens)
        path = workdir / "models.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        cmd = ["vita", "run", "--domain", args.domain, "--agent-llm", name]
        cmd += ["--user-llm", args.user_llm, "--evaluator-llm", args.evaluator_llm]
        cmd += ["--num-trials", str(args.num_trials), "--language", args.language]
        cmd += ["--max-concurrency", str(args.max_concurrency)]
        if args.num_tasks:
            cmd += ["--num-tasks", str(args.num_tasks)]
        cmd += extra
        print("running: " + " ".join(cmd), flush=True)
        env = dict(os.environ, VITA_MODEL_CONFIG_PATH=str(path.resolve()))
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
