"""LightLLM's operations routes (`lightllm/server/api_http.py`), in its response shapes: GET/POST
/liveness and /readiness, GET /healthz, /token_load, /get_model_name, /get_server_info, and GET/POST
/tokens (a prompt's token count). Health answers come from the frontend's own readiness check."""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from llaunch.runtime.config import Mode, RunConfig
from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import RequestLimits, check_prompt_text

_RUN_MODE = {Mode.normal: "normal", Mode.pd_prefill: "prefill", Mode.pd_decode: "decode", Mode.pd_master: "pd_master",
             Mode.config_server: "config_server"}


class TokensParameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    add_special_tokens: bool = True


class TokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str
    parameters: TokensParameters = msgspec.field(default_factory=TokensParameters)
    multimodal_params: Optional[dict[str, Any]] = None


def lightllm_server_info(cfg: RunConfig) -> dict[str, Any]:
    """GET /get_server_info: the server's settings under LightLLM's start-argument names (no secret)."""
    m, p, c, r, s = cfg.model, cfg.parallel, cfg.cache, cfg.router, cfg.server
    return {"run_mode": _RUN_MODE.get(cfg.mode.kind, str(cfg.mode.kind.value)), "host": s.host, "port": s.port,
            "model_name": m.name, "model_dir": m.path, "tp": p.tp, "dp": p.dp, "nnodes": p.nnodes,
            "node_rank": p.node_rank, "max_total_token_num": c.max_total_tokens, "mem_fraction": c.mem_fraction,
            "batch_max_tokens": r.batch_max_tokens, "running_max_req_size": r.max_running_requests,
            "max_req_total_len": m.max_model_len or m.max_position_embeddings,
            "eos_id": list(m.eos_token_ids or []), "data_type": m.dtype.value,
            "chunked_prefill_size": r.chunked_prefill_size, "disable_chunked_prefill": not r.chunked_prefill,
            "router_max_wait_tokens": r.max_wait_tokens, "router_token_ratio": r.token_ratio,
            "disable_dynamic_prompt_cache": not c.prompt_cache, "diverse_mode": r.diverse_mode,
            "token_healing_mode": s.token_healing, "return_all_prompt_logprobs": s.return_all_prompt_logprobs,
            "use_tgi_api": s.tgi_api, "use_reward_model": m.task.value == "score",
            "enable_multimodal": bool(m.vision or m.audio), "metric_port": s.metrics_port,
            "http_workers": s.http_workers}


def token_load(metrics_text: Optional[str], replicas: int) -> dict[str, Any]:
    """GET /token_load: each replica's share of its KV cache in use (llaunch:kv_cache_usage_perc). The
    router publishes no peak estimate, so logical_max_load and dynamic_max_load repeat that share
    (LightLLM's own logical_max_load equals its dynamic one). One replica: numbers, not lists."""
    load = [0.0] * replicas
    for family in text_string_to_metric_families(metrics_text or ""):
        for sample in family.samples:
            if sample.name == "llaunch:kv_cache_usage_perc":
                rank = int(sample.labels.get("dp_rank", 0))
                if 0 <= rank < replicas:
                    load[rank] = float(sample.value)
    out: dict[str, Any] = {"current_load": load, "logical_max_load": list(load), "dynamic_max_load": list(load)}
    return {k: v[0] for k, v in out.items()} if replicas == 1 else out


class TokensApi:
    def __init__(self, tokenizer: PromptTokenizer, limits: RequestLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    async def count(self, body: bytes) -> dict[str, int]:
        return await asyncio.to_thread(self._count, body)

    def _count(self, body: bytes) -> dict[str, int]:
        req = decode_body(body, TokensRequest)
        if req.multimodal_params and any(req.multimodal_params.get(k) for k in ("images", "audios")):
            raise bad_request("/tokens counts text only; images and audio count in a request's usage.",
                              param="multimodal_params")
        check_prompt_text(req.text, self.limits, param="text")
        encode = self.tokenizer.encode if req.parameters.add_special_tokens else self.tokenizer.encode_plain
        return {"ntokens": len(encode(req.text))}
