"""`python -m envace_jax.serve --model DIR`: serve an HF model directory over OpenAI's API.

The directory is what `models.hf_io.save_hf_model` writes (config.json, safetensors, and the
tokenizer files with a chat template). Any template that renders a chat with a generation prompt
and ends an assistant message with a special token is served (`text.serving_template`); tools
are offered where the template renders them. The server binds 127.0.0.1 unless told
otherwise; `--port 0` picks a free port, and `--port-file F` writes the bound port to F once the
server accepts requests, and removes it on exit. F belongs to one live server: a second server
given it refuses to start (F.lock holds the owner's PID, `runtime.locks`). The port is taken
before the model loads, so a busy port is one line at once. SIGINT / SIGTERM shut down
gracefully: no new connections, running requests finish (up to `--graceful-timeout` seconds),
and those still running then are answered with a 503 JSON error (a stream: its last event,
then `[DONE]`), then the engine stops.

The API key is best passed as `$ENVACE_API_KEY`: a `--api-key` argument is visible to every
user of the machine in `ps`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys

from envace_jax.runtime.locks import LockHeld, PidLock
from envace_jax.serve.limits import Limits

log = logging.getLogger("envace_jax.serve")
# uvicorn's own deadline for running requests, after ours (`--graceful-timeout`) has ended
# them: a backstop it should never reach.
_BACKSTOP_S = 10.0


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(
        max_request_bytes=args.max_request_bytes,
        max_rows_per_request=args.max_rows_per_request,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
    )


def build_server(args: argparse.Namespace):
    """Loads the model and tokenizer the command line names (`parse_args`) and returns (asgi
    app, ServerConfig)."""
    from envace_jax.models.hf_io import load_hf_model
    from envace_jax.sampling.loop import TurnSpec
    from envace_jax.serve.app import create_app
    from envace_jax.serve.batcher import Engine
    from envace_jax.serve.config import ServerConfig
    from envace_jax.text.serving_template import serving_template
    from envace_jax.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    template = serving_template(tokenizer)  # before the weights: a bad template fails fast
    overrides = {"param_dtype": args.param_dtype} if args.param_dtype else {}
    model, cfg = load_hf_model(args.model, **overrides)
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} ids but the model's vocab_size is {cfg.vocab_size}"
        )
    limit = args.max_model_len or cfg.max_position_embeddings
    # One spec serves both endpoints: a row stops at the end-of-turn id (or an end-of-text id).
    spec = TurnSpec(
        end_id=template.stop_id,
        tool_call_id=template.tool_call_id,
        abort_ids=template.abort_ids,
        mode="generate",
        max_message_tokens=1 << 30,
    )
    pad = tokenizer.pad_token_id
    engine = Engine(
        model,
        spec,
        pad_id=template.stop_id if pad is None else pad,
        max_batch=args.max_batch,
        chunk_steps=args.chunk_steps,
        wait_s=args.batch_wait_ms / 1000,
        max_wait_s=args.batch_max_wait_ms / 1000,
        seed=args.seed,
    )
    path = os.path.normpath(args.model)
    name = args.served_model_name or os.path.basename(path)
    config = ServerConfig(
        model_name=name,
        max_model_len=limit,
        aliases=tuple({args.model, path, os.path.abspath(path)} - {name}),
        default_max_tokens=args.default_max_tokens,
        api_key=args.api_key,
        limits=limits_of(args),
    )
    return create_app(engine, tokenizer, config), config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m envace_jax.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", required=True, help="HF model directory (config, safetensors, tokenizer)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--served-model-name", default=None, help="model id (default: directory name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion limit")
    p.add_argument("--max-batch", type=int, default=32, help="most rows decoded together")
    p.add_argument(
        "--chunk-steps", type=int, default=16, help="tokens decoded per look at the queue"
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="batching window when idle: a batch opens once no request came for this long",
    )
    p.add_argument("--batch-max-wait-ms", type=float, default=25.0, help="longest batching window")
    p.add_argument("--default-max-tokens", type=int, default=None, help="chat budget if unset")
    p.add_argument("--seed", type=int, default=0, help="sampling PRNG seed")
    p.add_argument(
        "--api-key",
        default=os.environ.get("ENVACE_API_KEY"),
        help="require Authorization: Bearer KEY (default: $ENVACE_API_KEY, the better way: an "
        "argument shows in ps; none: open)",
    )
    d = Limits()  # the defaults, declared once (`limits.Limits` says what each does)
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="body size")
    p.add_argument(
        "--max-rows-per-request", type=int, default=d.max_rows_per_request, help="prompts x n"
    )
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open connections"
    )
    p.add_argument(
        "--header-timeout", type=float, default=d.header_timeout, help="seconds for a request head"
    )
    p.add_argument(
        "--body-timeout", type=float, default=d.body_timeout, help="seconds for a request body"
    )
    p.add_argument("--param-dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds to drain on exit")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    try:
        limits_of(args)
    except ValueError as e:
        p.error(str(e).replace("_", "-"))
    return args


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, before the model loads: a busy port fails at once, and clients
    that connect meanwhile wait in the backlog until the server answers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past closed connections
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _port_file(path: str | None):
    """Owns `path` while the server runs (`path`.lock); removes both on exit. A stale port
    file (its server is gone) is removed at once: it names a dead port."""
    if path is None:
        yield
        return
    lock = PidLock(path + ".lock").acquire()
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        lock.release()


def _write_port_file(path: str, port: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)  # readers never see a partial file


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        with _port_file(args.port_file):
            sock = _listen(args.host, args.port)
            with sock:
                return _serve(args, sock)
    except LockHeld as e:
        print(
            f"envace_jax.serve: --port-file {args.port_file} belongs to a running server "
            f"(process {e.pid}); give another --port-file",
            file=sys.stderr,
        )
    except OSError as e:
        print(
            f"envace_jax.serve: cannot listen on {args.host}:{args.port}: {e.strerror}",
            file=sys.stderr,
        )
    return 1


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from envace_jax.serve import connections

    try:
        app, config = build_server(args)
    except (OSError, ValueError) as e:  # a missing directory, a template that cannot serve
        print(f"envace_jax.serve: {e}", file=sys.stderr)
        return 2
    limits = config.limits
    most, warning = connections.effective_max_connections(limits.max_connections)
    if warning:
        log.warning("%s", warning)
    connections.quiet_accept_errors()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=connections.guarded_protocol(dataclasses.replace(limits, max_connections=most)),
            log_level=args.log_level,
            timeout_graceful_shutdown=args.graceful_timeout + _BACKSTOP_S,
        )
    )
    state = app.server_state

    async def end_running_requests():
        """At SIGINT / SIGTERM: after --graceful-timeout, the requests still running are
        answered with the documented 503 (uvicorn would cancel them: a bare 500, a cut stream)."""
        while not server.should_exit:
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.graceful_timeout)
        state.abort_all()

    async def serve():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = sock.getsockname()[1]
            log.info(
                "serving %r (max_model_len %d) at http://%s:%d/v1",
                config.model_name,
                config.max_model_len,
                args.host,
                port,
            )
            if args.port_file:
                _write_port_file(args.port_file, port)
        ender = asyncio.create_task(end_running_requests())
        try:
            await task
        finally:
            ender.cancel()

    # uvicorn re-raises the signal that stopped it once it has shut down; with these no-op
    # handlers in place beforehand, a graceful shutdown ends the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    connections.run(serve())
    log.info("shut down")
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
