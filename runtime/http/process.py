"""Frontend process entry: `python -m llaunch.runtime.http.process --config RUN_DIR/config.yaml --name
frontend.{i} [--listen-fd FD]`. Serves the app with Hypercorn on the listening socket the launcher
passes (or binds server.host:port itself), wires the engine over ZMQ, and handles signals:
SIGTERM drains, SIGINT stops at once."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from typing import Optional

import zmq
import zmq.asyncio
from quart import Quart

from llaunch.runtime.api_key import read_api_key
from llaunch.runtime.config import Mode, ProcessSpec, RunConfig
from llaunch.runtime.bootstrap import report_ready, start
from llaunch.runtime.http.app import FrontendSettings, create_app
from llaunch.runtime.http.engine_client import EngineClient, ZmqEngineLink
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.web.serve import serve_until_stopped, stop_on_signals
from llaunch.runtime.http.pd_instance import start_registrar
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

STOP_NOW_GRACE_S = 1.0  # SIGINT: open streams write their error event and [DONE], idle connections close


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind here when no launcher passed a socket, so Hypercorn always serves an already-listening fd."""
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=2048, reuse_port=False)
    sock.set_inheritable(True)
    return sock


async def serve_app(app: Quart, fd: int, lifecycle: Lifecycle, engine: Optional[EngineClient] = None) -> None:
    """Serve until the lifecycle's drain (or immediate stop) is over, then close every connection. A
    drain that times out, or a stop (SIGINT: llaunch was interrupted, or a process of the graph died
    and the launcher tears it down), first ends every open request with an error (a stream: its error
    event and [DONE]) and leaves the graceful timeout for those last bytes."""

    async def fail_open_requests(drained: bool) -> None:
        if engine is None:
            return
        if lifecycle.stopping_now:
            await engine.fail_all("shutdown", "The server stopped before the request finished (llaunch was "
                                              "stopped, or a process of its graph exited).")
        elif not drained:
            await engine.fail_all("shutdown", "The server stopped before the request finished "
                                              "(server.drain_timeout_s ran out).")

    await serve_until_stopped(app, [f"fd://{fd}"], lifecycle, STOP_NOW_GRACE_S, fail_open_requests)


async def run_frontend(cfg: RunConfig, spec: ProcessSpec, tokenizer: PromptTokenizer, fd: int,
                       api_key: Optional[str] = None) -> None:
    ctx = zmq.asyncio.Context()
    link = ZmqEngineLink(ctx, spec)
    engine = EngineClient(spec.index, link.num_replicas, link.post, cfg.server.request_timeout_s,
                          prefill_balance=cfg.router.dp_prefill_balance,
                          affinity_slack=cfg.router.dp_affinity_slack_tokens if cfg.router.dp_prefix_affinity else None)
    lifecycle = Lifecycle()
    pd_role = {Mode.pd_prefill: "prefill", Mode.pd_decode: "decode"}.get(cfg.mode.kind)
    app = create_app(FrontendSettings.from_run_config(cfg, tokenizer, api_key), engine, tokenizer, lifecycle, pd_role)
    pump = asyncio.ensure_future(link.pump(engine))
    registrar = None

    @app.before_serving
    async def ready() -> None:
        # The socket already listens (launcher or listening_socket), so requests queue from here on.
        sync_ctx = zmq.Context()
        report_ready(sync_ctx, cfg, spec, url=cfg.graph.http_url, replicas=str(link.num_replicas))
        sync_ctx.term()
        nonlocal registrar
        registrar = start_registrar(cfg, spec, engine)  # a pd instance joins its master from here on

    stop_on_signals(lifecycle, cfg.server.drain_timeout_s)
    try:
        await serve_app(app, fd, lifecycle, engine)
        if engine.running:  # the drain timed out: the router should not keep generating for nobody
            await engine.abort_all()
    finally:
        if registrar is not None:
            registrar.stop()
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        link.close()
        ctx.term()


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--listen-fd", type=int, default=None)  # the launcher's listening socket, inherited
    own, rest = ap.parse_known_args(argv)
    cfg, spec = start(rest)
    api_key = read_api_key(cfg)
    # Hypercorn wraps the fd in its own socket object and closes it; detach so nothing else does.
    fd = own.listen_fd if own.listen_fd is not None else listening_socket(cfg.server.host, cfg.server.port).detach()
    hf = load_tokenizer(cfg.model)
    if cfg.server.chat_template:  # replaces the tokenizer's (launcher/rules_server.py read it at start)
        with open(cfg.server.chat_template, encoding="utf-8") as f:
            hf.chat_template = f.read()
    fmt = cfg.server.tool_call_format
    tokenizer = PromptTokenizer(hf, vocab_size=cfg.model.vocab_size, tool_call_format=fmt.value if fmt else None)
    asyncio.run(run_frontend(cfg, spec, tokenizer, fd, api_key))
    log.info("stopped")


if __name__ == "__main__":
    main()
