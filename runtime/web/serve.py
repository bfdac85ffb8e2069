"""Hypercorn serving for every llaunch HTTP app (frontend, pd_master, config server): one config, and one
loop that serves until the app's Lifecycle says its drain (or an immediate stop) is over."""
from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable, Optional
from urllib.parse import urlsplit

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart

from llaunch.runtime.web.lifecycle import Lifecycle

AFTER_DRAIN_GRACE_S = 2.0  # drained: connections only have their last bytes (and keep-alives) to close
KEEP_ALIVE_S = 75.0


def hypercorn_config(binds: list[str]) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = binds
    config.backlog = 2048
    config.graceful_timeout = AFTER_DRAIN_GRACE_S
    # longer than clients' pools keep idle connections, so a request never lands on a socket the
    # server is closing (suspected cause of rare ReadErrors at 256 concurrent streams; unconfirmed)
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.accesslog = None
    return config


def hypercorn_bind(url: str) -> str:
    """http://host:port -> host:port as Hypercorn binds it ([::1]:port for IPv6)."""
    netloc = urlsplit(url).netloc
    if not netloc:
        raise ValueError(f"not an http URL: {url!r}")
    return netloc


def stop_on_signals(lifecycle: Lifecycle, drain_timeout_s: float) -> None:
    """SIGTERM drains (in-flight requests finish within `drain_timeout_s`), SIGINT stops at once."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lifecycle.drain, drain_timeout_s)
    loop.add_signal_handler(signal.SIGINT, lifecycle.stop_now)


async def serve_until_stopped(app: Quart, binds: list[str], lifecycle: Lifecycle, stop_now_grace_s: float,
                              on_stop: Optional[Callable[[bool], Awaitable[None]]] = None) -> None:
    """Serve `app` on `binds` until the lifecycle's drain (or immediate stop) is over, then close every
    connection: within AFTER_DRAIN_GRACE_S after a drain, `stop_now_grace_s` after a stop.
    `on_stop(drained)` runs first (drained: False when the drain timed out)."""
    config = hypercorn_config(binds)

    async def shutdown_trigger() -> None:
        drained = await lifecycle.wait_drained()
        if lifecycle.stopping_now:
            config.graceful_timeout = stop_now_grace_s
        if on_stop is not None:
            await on_stop(drained)

    await serve(app, config, shutdown_trigger=shutdown_trigger)
