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

import os
import subprocess
import sys
from pathlib import Path

from envace_jax.eval import serving

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

    argv, extra = serving.split_argv(argv)
    p = serving.harness_parser(
        "python -m envace_jax.eval.vitabench", __doc__, workdir="vitabench_out"
    )
    p.add_argument("--models-yaml", required=True, help="your models.yaml (user, evaluator)")
    p.add_argument("--user-llm", required=True)
    p.add_argument("--evaluator-llm", required=True)
    p.add_argument("--domain", default="delivery", help="delivery, instore, ota or a list")
    p.add_argument("--language", default="english", choices=("english", "chinese"))
    args = p.parse_args(argv)
    if serving.cli_missing("vita", INSTALL):
        return 2
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with open(args.models_yaml, encoding="utf-8") as f:
        base = yaml.safe_load(f) or {}
    name = serving.served_name(args.model)
    with serving.served(args.model, workdir, serving.server_flags(args)) as url:
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
