"""The loop of a worker process (`envs.worker_process`), run by a third-party package's venv:

    <venv>/bin/python worker_loop.py <world module file>

The world module (bfcl_multi_turn/worker.py, tau2_solo/worker.py) imports only the standard
library and its package, and defines `answer(request) -> value`. The loop reads one JSON
request per line on stdin and writes `{"ok": value}` or `{"error": "..."}` per line on stdout;
whatever the package prints goes to stderr, the worker's log.
"""

import importlib.util
import json
import sys

sys.path.pop(0)  # this folder: its modules are ours, not the package's


def main(path: str) -> None:
    spec = importlib.util.spec_from_file_location("world", path)
    world = importlib.util.module_from_spec(spec)
    out = sys.stdout
    sys.stdout = sys.stderr  # the package prints; only answers go to the pipe
    spec.loader.exec_module(world)
    for line in sys.stdin:
        try:
            reply = {"ok": world.answer(json.loads(line))}
        except Exception as exc:  # the caller turns it into an error it can name
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
