"""mode=config_server: an HTTP registry through which several pd_masters and their prefill/decode
instances find each other. Everyone heartbeats `POST /register {"id", "role", "url", ...}`; `GET
/registry?role=master` lists the live entries (last heartbeat within the timeout), extra fields kept.

`python -m llaunch.runtime.pd_master.config_server --config RUN_DIR/config.yaml --name config_server` serves
on mode.config_server_host:config_server_port (the plan's `http` bind)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

import zmq
from quart import Quart, Response, request

from llaunch.runtime.config import ProcessSpec, RunConfig
from llaunch.runtime.bootstrap import report_ready, start
from llaunch.runtime.web.errors import bad_request, json_response
from llaunch.runtime.web.guards import json_errors
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.pd_master.process import HEARTBEAT_TIMEOUT_S, serve_urls

log = logging.getLogger(__name__)

ROLES = ("master", "prefill", "decode")


class Directory:
    """Live registrations by id; an entry whose heartbeat is older than the timeout is not listed."""

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._entries: dict[str, tuple[dict[str, Any], float]] = {}  # id -> (entry, last seen)

    def register(self, entry: dict[str, Any]) -> None:
        for key in ("id", "role", "url"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ValueError(f"`{key}` must be a non-empty string")
        if entry["role"] not in ROLES:
            raise ValueError(f"`role` must be one of {', '.join(ROLES)}, got {entry['role']!r}")
        now = self._clock()
        self._entries[entry["id"]] = (entry, now)
        for k in [k for k, (_, seen) in self._entries.items() if now - seen > self.forget_after_s]:
            del self._entries[k]

    def live(self, role: Optional[str] = None) -> list[dict[str, Any]]:
        now = self._clock()
        return [entry | {"last_seen_s": round(now - seen, 3)}
                for entry, seen in sorted(self._entries.values(), key=lambda e: e[0]["id"])
                if now - seen <= self.heartbeat_timeout_s and role in (None, entry["role"])]


def create_config_app(directory: Directory) -> Quart:
    app = Quart("llaunch.config_server")

    json_errors(app, log)

    @app.post("/register")
    async def register() -> Response:
        entry = decode_body(await request.get_data(), dict[str, Any])  # any extra fields are kept
        try:
            directory.register(entry)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return json_response({"ok": True, "heartbeat_timeout_s": directory.heartbeat_timeout_s})

    @app.get("/registry")
    async def registry() -> Response:
        role = request.args.get("role")
        if role is not None and role not in ROLES:
            raise bad_request(f"role must be one of {', '.join(ROLES)}, got {role!r}", param="role")
        return json_response({"entries": directory.live(role)})

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok", "entries": len(directory.live())})

    return app


async def run_config_server(cfg: RunConfig, spec: ProcessSpec) -> None:
    url = spec.binds["http"]

    def listening() -> None:
        ctx = zmq.Context()
        report_ready(ctx, cfg, spec, url=url)
        ctx.term()

    await serve_urls(create_config_app(Directory()), [url], Lifecycle(), cfg.server.drain_timeout_s, listening)


def main(argv: Optional[list[str]] = None) -> None:
    cfg, spec = start(argv)
    asyncio.run(run_config_server(cfg, spec))
    log.info("stopped")


if __name__ == "__main__":
    main()
