"""GET /openapi.json: the frontend's API as OpenAPI 3.1, its request bodies generated from the msgspec
structs the routes decode with (so the schema carries the same field types and bounds), and the
error body every 4xx/5xx has. CI fuzzes the server against it (tests/integration/test_openapi.py)."""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from llaunch.runtime.http.anthropic_api import CountTokensRequest, MessagesRequest
from llaunch.runtime.http.embeddings_api import EmbeddingRequest
from llaunch.runtime.http.generate_api import GenerateRequest
from llaunch.runtime.http.lightllm_ops import TokensRequest
from llaunch.runtime.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.http.responses_api import ResponsesRequest
from llaunch.runtime.http.tgi_api import TgiRequest
from llaunch.runtime.http.rerank_api import RerankRequest
from llaunch.runtime.http.score_api import ClassifyRequest, GetScoreRequest, ScoreRequest
from llaunch.runtime.http.tokenize_api import DetokenizeRequest, TokenizeChat, TokenizeCompletion


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    """Anthropic's error shape, which /v1/messages* answer (runtime/http/anthropic_api.py)."""

    type: str
    error: AnthropicErrorDetail


_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
           "/v1/messages/count_tokens": CountTokensRequest,
           "/generate": GenerateRequest, "/generate_stream": GenerateRequest, "/tokenize": (TokenizeCompletion, TokenizeChat),
           "/detokenize": DetokenizeRequest,
           # a score model's (model.task=score); a generating model answers them with a 400
           "/get_score": GetScoreRequest, "/classify": ClassifyRequest, "/v1/score": ScoreRequest,
           "/v1/rerank": RerankRequest, "/rerank": RerankRequest, "/v2/rerank": RerankRequest,
           "/v1/embeddings": EmbeddingRequest,  # an embedding model's (model.task=embed); others answer a 400
           "/tokens": TokensRequest}
_GETS = {"/v1/models": "The served model.", "/health": "Ready to serve (as /health/ready).",
         "/health/live": "The process answers.", "/health/ready": "Ready to serve new requests.",
         "/metrics": "Prometheus metrics (text).", "/openapi.json": "This document.",
         # LightLLM's operations routes
         "/healthz": "LightLLM's health: {message: Ok} (503: Error).", "/liveness": "LightLLM's liveness.",
         "/readiness": "LightLLM's readiness.", "/token_load": "LightLLM's token load per replica.",
         "/get_model_name": "LightLLM's model name.", "/get_server_info": "LightLLM's server settings."}


def _responses(ok: str, content_types: tuple[str, ...] = ("application/json",),
               error_body: str = "ErrorBody") -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_body}"}}}}
    return {"200": {"description": ok, "content": {t: {"schema": {}} for t in content_types}},
            "4XX": {"description": "The request was refused; the error names the field.", **error},
            "5XX": {"description": "The server could not serve it (draining, overloaded, stalled).", **error}}


def _body_schema(body, ref: dict) -> dict[str, Any]:
    """One struct's schema, or any of several (a route that takes either shape)."""
    return {"anyOf": [ref[b] for b in body]} if isinstance(body, tuple) else ref[body]


def _narrow(schema: dict[str, Any], field: str, **bounds: Any) -> None:
    """Tighten a property's non-null alternative with what this server's model allows."""
    prop = schema["properties"].get(field)
    if prop is not None:
        for alternative in prop.get("anyOf", [prop]):
            if alternative.get("type") != "null":
                alternative.update(bounds)


def openapi_document(limits: RequestLimits, api_key: bool, tgi: bool = False,
                     warn_unknown_fields: bool = True) -> dict[str, Any]:
    """`tgi` (server.tgi_api): /generate, /generate_stream and / take TGI's request; GET /info.
    `warn_unknown_fields` (server.unknown_fields=warn): objects may carry other properties (served
    without them); else they are refused (additionalProperties false)."""
    native = TgiRequest if tgi else GenerateRequest
    bodies = {**_BODIES, "/generate": native, "/generate_stream": native, **({"/": native} if tgi else {})}
    gets = {**_GETS, **({"/info": "text-generation-inference's info."} if tgi else {})}
    types = [CompletionRequest, ChatCompletionRequest, native, TokenizeCompletion, TokenizeChat,
             DetokenizeRequest, GetScoreRequest, ClassifyRequest, ScoreRequest, RerankRequest, EmbeddingRequest,
             TokensRequest, ResponsesRequest, MessagesRequest, CountTokensRequest, ErrorBody, AnthropicErrorBody]
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest",
                 "CountTokensRequest"):
        _narrow(components[name], "model", enum=[limits.served_name])
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            _narrow(components[name], field, maximum=limits.max_model_len)
    _narrow(components["TgiParameters" if tgi else "GenerateParameters"], "max_new_tokens", maximum=limits.max_model_len)
    if warn_unknown_fields:
        for schema in components.values():
            schema.pop("additionalProperties", None)
    ref = dict(zip(types, refs))
    paths: dict[str, Any] = {}
    for path, body in bodies.items():
        streams = ("application/json", "text/event-stream")
        paths[path] = {"post": {"operationId": path.strip("/").replace("/", "_") or "tgi_compat",
                                "requestBody": {"required": True,
                                                "content": {"application/json": {"schema": _body_schema(body, ref)}}},
                                "responses": _responses("The generated text.", streams, "AnthropicErrorBody"
                                                        if path.startswith("/v1/messages") else "ErrorBody")}}
    for path, what in gets.items():
        kind = ("text/plain",) if path == "/metrics" else ("application/json",)
        paths[path] = {"get": {"operationId": path.strip("/").replace("/", "_").replace(".", "_") or "root",
                               "responses": _responses(what, kind)}}
    paths["/flush_cache"] = {"post": {"operationId": "flush_cache",
                                      "responses": _responses("The prompt cache was flushed.")}}
    start = {"type": "object", "additionalProperties": False, "properties": {
        "num_steps": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        "activities": {"type": "array", "items": {"enum": ["CPU", "GPU"]}},
        "record_shapes": {"type": "boolean"}, "with_stack": {"type": "boolean"}}}
    paths["/start_profile"] = {"post": {
        "operationId": "start_profile", "description": "Every worker runs torch.profiler (server.profile_dir; else 400).",
        "requestBody": {"required": False, "content": {"application/json": {"schema": start}}},
        "responses": _responses("The workers start profiling with their next step.")}}
    paths["/stop_profile"] = {"post": {"operationId": "stop_profile",
                                       "responses": _responses("The workers write their traces to server.profile_dir.")}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "llaunch", "version": "1", "description": (
            f"Serves `{limits.served_name}`: context {limits.max_model_len} tokens, vocabulary {limits.vocab_size}; "
            f"at most {limits.max_prompts} prompts and {limits.max_choices} completions per request, "
            f"{limits.max_stop_strings} stop strings of {limits.max_stop_string_chars} characters.")},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for path in ("/health", "/health/live", "/health/ready", "/healthz", "/liveness", "/readiness", "/openapi.json"):
            doc["paths"][path]["get"]["security"] = []
    return doc
