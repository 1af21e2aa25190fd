"""Clients that hang up mid-request, streamed or not, over real HTTP on 127.0.0.1: their rows
are released (the engine ends them as 'cancelled'), the server log stays quiet (no traceback,
no `CancelledError`), and the next request is answered."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.serve_helpers import MODEL, chat, export_test_model, port_file_path, running_server

MAX_LEN = 8192  # a long context: a hung-up request still has seconds of budget left
BUDGET = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, its log file)."""
    model_dir = str(tmp_path_factory.mktemp("disconnect") / MODEL)
    export_test_model(model_dir, max_position_embeddings=MAX_LEN)
    port_file = port_file_path(model_dir)
    with running_server(model_dir, port_file=port_file) as (url, _):
        yield url, port_file + ".log"


def _finished(http) -> dict[str, int]:
    stats = http.get("/health").json()["engine"]
    return {k: n for k, n in stats.items() if k.startswith("finished_")}


def _hang_up(url: str, path: str, body: dict) -> None:
    """Sends `body` and leaves: a stream after its first event, a plain request after 1 s."""
    with httpx.Client(base_url=url, timeout=1.0) as impatient:
        if body.get("stream"):
            with impatient.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line)
        else:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(path, json=body)


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": BUDGET, "temperature": 0.0}
CHAT = chat("Weather?", max_tokens=BUDGET, temperature=0.0)  # greedy: runs its whole budget


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    "path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_a_client_that_hangs_up_releases_its_rows_without_a_traceback(server, path, body, stream):
    url, log_path = server
    with httpx.Client(base_url=url, timeout=300) as http:
        before = _finished(http)
        _hang_up(url, path, {**body, "n": 2, "stream": stream})
        deadline = time.monotonic() + 120
        while sum(_finished(http).values()) < sum(before.values()) + 2:
            assert time.monotonic() < deadline, "the rows were never released"
            time.sleep(0.05)
        after = _finished(http)
        ended = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        assert ended == {"finished_cancelled": 2}, (before, after)
        resp = http.post(path, json={**body, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    log = open(log_path).read() if os.path.exists(log_path) else ""
    for marker in ("Traceback", "CancelledError", "never retrieved"):
        assert marker not in log, log
