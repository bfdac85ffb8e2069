"""pd_master process entry: `python -m llaunch.runtime.pd_master.process --config RUN_DIR/config.yaml
--name pd_master`. One Hypercorn server, one registry, two binds: the client URL (server.host:port) and
the URL instances register at (mode.pd_master_host:pd_master_port). Registers itself with the config
server when the plan dials one. SIGTERM drains (in-flight requests finish), SIGINT stops at once."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import zmq
from quart import Quart

from llaunch.runtime.config import ProcessSpec, RunConfig
from llaunch.runtime.api_key import read_api_key
from llaunch.runtime.bootstrap import report_ready, start
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.web.serve import hypercorn_bind, serve_until_stopped, stop_on_signals
from llaunch.runtime.pd_master.app import MasterSettings, create_master_app
from llaunch.runtime.web.registrar import Registrar
from llaunch.runtime.pd_master.registry import InstanceRegistry

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 3.0  # an instance silent this long gets no new requests (a mode.* field later)
REGISTER_INTERVAL_S = 1.0
STOP_NOW_GRACE_S = 0.2


async def serve_urls(app: Quart, urls: list[str], lifecycle: Lifecycle, drain_timeout_s: float,
                     on_listening: Callable[[], None]) -> None:
    """Serve `app` on every URL until SIGTERM's drain ends (or SIGINT); `on_listening` runs once the
    sockets listen, before the first request is read."""

    @app.before_serving
    async def listening() -> None:  # Hypercorn binds and listens before the app starts up
        on_listening()

    stop_on_signals(lifecycle, drain_timeout_s)
    await serve_until_stopped(app, [hypercorn_bind(u) for u in urls], lifecycle, STOP_NOW_GRACE_S)


def self_registrar(cfg: RunConfig, spec: ProcessSpec, lifecycle: Lifecycle) -> Optional[Registrar]:
    """The master's heartbeat to the config server (when the plan dials one), listing both its URLs."""
    config_server = spec.connects.get("config_server")
    if not config_server:
        return None
    http, register = spec.binds["http"], spec.binds["register"]

    def load() -> dict:  # runs on the registrar's thread: read one int, touch nothing the loop mutates
        return {"running": lifecycle.in_flight, "waiting": 0, "kv_used": 0.0}

    return Registrar("master", f"pd_master@{hypercorn_bind(http)}", http, None, cfg.model.name, load,
                     config_server_url=config_server, interval_s=REGISTER_INTERVAL_S,
                     extra={"register_url": register})


async def run_master(cfg: RunConfig, spec: ProcessSpec, api_key: Optional[str] = None) -> None:
    registry = InstanceRegistry(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    lifecycle = Lifecycle()
    app = create_master_app(registry, MasterSettings.from_run_config(cfg, api_key), lifecycle)
    registrar = self_registrar(cfg, spec, lifecycle)
    urls = [spec.binds["http"], spec.binds["register"]]

    def listening() -> None:
        ctx = zmq.Context()
        report_ready(ctx, cfg, spec, url=urls[0], register=urls[1])
        ctx.term()
        if registrar is not None:
            registrar.start()

    try:
        await serve_urls(app, urls, lifecycle, cfg.server.drain_timeout_s, listening)
    finally:
        if registrar is not None:
            registrar.stop()


def main(argv: Optional[list[str]] = None) -> None:
    cfg, spec = start(argv)
    asyncio.run(run_master(cfg, spec, read_api_key(cfg)))
    log.info("stopped")


if __name__ == "__main__":
    main()
