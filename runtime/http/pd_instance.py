"""The frontend of a pd_prefill / pd_decode instance: requests the pd_master relays carry a transfer
id (and, to a prefill instance, the decode instance's KV address) in headers. Both instances
tokenize the same body, so both see the same prompt ids; each engine request of it (one per choice)
gets the link `<pd id>.<choice>`.

- decode instance: the request is served as usual (JSON or stream); its router waits for the
  prompt's KV instead of prefilling it.
- prefill instance: the request is prefilled, its KV sent, and the answer is
  `{"pd_id", "prompt_tokens", "kv_transfer_ms"}` once every choice's KV is acknowledged.
A request without the headers (a client calling the instance directly) is served normally.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from typing import Optional

from quart import Response

from llaunch.runtime.config import Mode, ProcessSpec, RunConfig
from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.web.errors import ApiError, engine_failed, json_response
from llaunch.runtime.http.generate_api import GenerateRequest, generate_jobs
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, RequestLimits, chat_choices,
                                                  chat_prompt, check_model, completion_choices, completion_prompts)
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.ipc.messages import PdLink, SamplingParams
from llaunch.runtime.ipc.pd import DECODE_KV_HEADER, PD_ID_HEADER
from llaunch.runtime.web.registrar import Registrar

log = logging.getLogger(__name__)


def link_from_headers(headers) -> Optional[PdLink]:
    pd_id = headers.get(PD_ID_HEADER)
    return PdLink(id=pd_id, decode_kv=headers.get(DECODE_KV_HEADER) or None) if pd_id else None


class PrefillServing:
    """A prefill instance's answer to the master: the prompt's KV is on the decode instance."""

    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle):
        self.engine, self.tokenizer, self.limits, self.lifecycle = engine, tokenizer, limits, lifecycle

    def jobs(self, path: str, body: bytes) -> list[tuple[list[int], SamplingParams]]:
        """The engine requests the normal route would submit for this body (same validation)."""
        if path == "/v1/completions":
            req = decode_body(body, CompletionRequest)
            check_model(req.model, self.limits)
            choices = completion_choices(req, completion_prompts(req, self.tokenizer, self.limits), self.limits,
                                         self.tokenizer)
        elif path == "/v1/chat/completions":
            req = decode_body(body, ChatCompletionRequest)
            check_model(req.model, self.limits)
            choices = chat_choices(req, chat_prompt(req, self.tokenizer, self.limits), self.limits, self.tokenizer)
        else:
            prompt_ids, samplings = generate_jobs(decode_body(body, GenerateRequest), self.tokenizer, self.limits,
                                                  stream=path == "/generate_stream")
            return [(prompt_ids, s) for s in samplings]
        return [(c.prompt_ids, c.sampling) for c in choices]

    async def handle(self, path: str, body: bytes, link: PdLink) -> Response:
        if not link.decode_kv:
            raise ApiError(400, f"{PD_ID_HEADER} without {DECODE_KV_HEADER}: where should the KV go?",
                           param=DECODE_KV_HEADER)
        jobs = await asyncio.to_thread(self.jobs, path, body)  # tokenizing: off the event loop
        group = await self.engine.submit(jobs, pd=link, lifecycle=self.lifecycle)
        ms = 0.0
        try:
            async for _, delta in group:
                if delta.finish_reason is not None and delta.finish_reason != "kv_sent":
                    raise engine_failed(delta.finish_reason, delta.error)
                ms = max(ms, delta.kv_transfer_ms)
        finally:
            await group.close()
        return json_response({"pd_id": link.id, "prompt_tokens": sum(len(p) for p, _ in jobs), "kv_transfer_ms": ms})


def start_registrar(cfg: RunConfig, spec: ProcessSpec, engine: EngineClient) -> Optional[Registrar]:
    """Frontend 0 of a pd instance keeps it registered with its pd_master (or every master a config
    server lists), reporting the engine's load with each heartbeat."""
    kind = cfg.mode.kind
    if kind not in (Mode.pd_prefill, Mode.pd_decode) or spec.index != 0:
        return None
    m = cfg.mode
    config_server = f"http://{m.config_server_host}:{m.config_server_port}" if m.config_server_host else None

    def load() -> dict:
        snap = engine.metrics
        return {"running": snap.running if snap else 0, "waiting": snap.waiting if snap else 0, "kv_used": 0.0}

    registrar = Registrar(
        role="prefill" if kind == Mode.pd_prefill else "decode",
        instance_id=f"{socket.gethostname()}-{cfg.server.port}-{uuid.uuid4().hex[:6]}",
        url=cfg.graph.http_url, kv_address=spec.connects.get("kv_transfer"), model=cfg.model.name, load_fn=load,
        master_url=None if config_server else spec.connects["pd_master"], config_server_url=config_server)
    return registrar.start()
