"""The pd_master's Quart app: the OpenAI and LightLLM routes relayed through a prefill/decode pair
(runtime/pd_master/relay.py), instance registration by heartbeat, and the master's health and instance list.

The master never tokenizes: every instance is a full llaunch server that tokenizes the same body with
the same tokenizer, so P and D agree on the token ids.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Coroutine, Optional

import httpx
import msgspec
from quart import Quart, Response, request

from llaunch.runtime.config import RunConfig
from llaunch.runtime.web.errors import ApiError, bad_request, draining, error_response, json_response
from llaunch.runtime.web.guards import gatekeeper, json_errors
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.ipc.pd import Registration
from llaunch.runtime.pd_master.registry import InstanceRegistry, NoHealthyInstance
from llaunch.runtime.pd_master.relay import FORWARDED_HEADERS, PdExchange

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream")
_OPEN_PATHS = ("/health", "/pd/register", "/pd/instances")  # no API key: instances and probes use them
_DRAIN_EXEMPT = _OPEN_PATHS  # still answered while draining: instances keep their heartbeat


@dataclass(frozen=True)
class MasterSettings:
    api_key: Optional[str] = None  # checked here and forwarded to the instances as sent
    connect_timeout_s: float = 3.0  # to an instance; reads have no timeout (a long generation is fine)
    prefill_settle_s: float = 10.0  # after D finished: how long P's 200 may take before it is dropped

    @staticmethod
    def from_run_config(cfg: RunConfig, api_key: Optional[str] = None) -> "MasterSettings":
        return MasterSettings(api_key=api_key)


def _no_instance(e: NoHealthyInstance) -> ApiError:
    return ApiError(503, f"No healthy {e.role} instance is registered with this pd_master.",
                    type="service_unavailable", code=f"no_{e.role}_instance")


PREFIX_CHARS = 1024  # ~256 tokens: requests that agree this far likely share a cached system prompt


def prefix_key(body: bytes) -> Optional[str]:
    """What requests sharing a prompt prefix have in common, without tokenizing: the first
    PREFIX_CHARS of the prompt (completions, /generate) or of the messages (chat). None for a
    shorter prompt (too little cached KV to be worth steering for) or a body that is not JSON of
    that shape (the instance then reports the error)."""
    try:
        req = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(req, dict):
        return None
    text = req.get("messages", req.get("prompt", req.get("inputs")))
    if text is None:
        return None
    text = text if isinstance(text, str) else msgspec.json.encode(text).decode()
    if len(text) < PREFIX_CHARS:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=16).hexdigest()


def create_master_app(registry: InstanceRegistry, settings: MasterSettings,
                      lifecycle: Optional[Lifecycle] = None) -> Quart:
    app = Quart("llaunch.pd_master")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=64 * 1024 * 1024)
    lifecycle = lifecycle or Lifecycle()
    clients: list[httpx.AsyncClient] = []  # made in the serving loop
    background: set[asyncio.Task] = set()

    def spawn(coro: Coroutine) -> None:
        task = asyncio.ensure_future(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    @app.before_serving
    async def open_client() -> None:
        timeout = httpx.Timeout(None, connect=settings.connect_timeout_s)
        # no pool limit: every in-flight request holds two upstream connections (P and D)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30.0)
        clients.append(httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False))

    @app.after_serving
    async def close_client() -> None:
        for task in list(background):
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for client in clients:
            await client.aclose()

    gatekeeper(app, settings.api_key, lifecycle, _OPEN_PATHS, _DRAIN_EXEMPT)
    json_errors(app, log)

    def forwarded() -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}

    async def relay() -> Response:
        body = await request.get_data()
        try:
            pair = registry.pick_pair(prefix_key(body))
        except NoHealthyInstance as e:
            return error_response(_no_instance(e))
        exchange = PdExchange(clients[0], registry, pair, request.path, body, forwarded(), lifecycle, spawn,
                              settings.prefill_settle_s)
        return await exchange.answer()

    for path in GENERATION_PATHS:
        app.add_url_rule(path, endpoint=path, view_func=relay, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            decode = registry.pick("decode")
        except NoHealthyInstance as e:
            return error_response(_no_instance(e))
        try:
            r = await clients[0].get(decode.url + "/v1/models", headers=forwarded())
        except httpx.HTTPError as e:
            registry.mark_unhealthy(decode.id)
            return error_response(ApiError(502, f"The decode instance {decode.id} is unreachable "
                                                f"({type(e).__name__}).", type="server_error", code="decode_failed"))
        return Response(r.content, status=r.status_code, content_type=r.headers.get("content-type", "application/json"))

    @app.post("/pd/register")
    async def register() -> Response:
        registration = decode_body(await request.get_data(), Registration)
        try:
            registry.register(registration)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return json_response({"ok": True, "heartbeat_timeout_s": registry.heartbeat_timeout_s})

    @app.get("/pd/instances")
    async def instances() -> Response:
        return json_response({"instances": registry.snapshot()})

    @app.get("/health")
    async def health() -> Response:
        if lifecycle.draining:
            return error_response(draining())
        counts = registry.counts()
        if not all(counts.values()):
            missing = " and ".join(role for role, n in counts.items() if n == 0)
            return json_response(ApiError(503, f"No healthy {missing} instance is registered.",
                                          type="service_unavailable", code="no_instances").body()
                                 | counts, status=503)
        return json_response({"status": "ok"} | counts)

    return app

