"""text-generation-inference's API (server.tgi_api, LightLLM's use_tgi_api): POST /generate,
/generate_stream and / (TGI's compat route, where huggingface_hub's InferenceClient posts) with TGI's
request and response shapes, and GET /info. A request is translated into LightLLM's /generate request
and sampled by the same code (generate_api.generate_jobs); errors are TGI's {"error", "error_type"}."""
from __future__ import annotations

import asyncio
import random
from importlib import metadata
from typing import Annotated, Any, AsyncIterator, Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.config import RunConfig
from llaunch.runtime.http.engine_client import EngineClient, RequestGroup, admitted
from llaunch.runtime.web.errors import ApiError, bad_request, engine_failed, json_response, stream_error
from llaunch.runtime.http.generate_api import GenerateParameters, GenerateRequest, generate_jobs
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (MAX_TEMPERATURE, MAX_TOP_LOGPROBS, Penalty, RepetitionPenalty,
                                                 RequestLimits, Seed, TokenCount, TopP, check_prompt_text)
from llaunch.runtime.web.sse import TrackedStream, sse_event, sse_response
from llaunch.runtime.ipc.messages import TextDelta

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's, when a request leaves max_new_tokens unset
Temperature = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_TEMPERATURE)]  # TGI: strictly positive
TopK = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
TopNTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
# Our LightLLM field names in generate_jobs' errors → the TGI field the client sent
_TGI_PARAM = {"parameters.stop_sequences": "parameters.stop", "parameters.regular_constraint": "parameters.grammar",
              "parameters.guided_json": "parameters.grammar", "max_new_tokens": "parameters.max_new_tokens",
              "parameters.best_of": "parameters.best_of", "prompt": "inputs"}


class TgiGrammar(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # "json" (value: a JSON schema) | "regex" (value: a pattern)
    value: Union[dict[str, Any], str]


class TgiParameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: Optional[TokenCount] = None
    do_sample: bool = False
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    frequency_penalty: Optional[Penalty] = None
    stop: list[str] = []
    seed: Optional[Seed] = None
    details: bool = False
    decoder_input_details: bool = False  # details.prefill: each prompt token with its logprob (not streamed)
    return_full_text: Optional[bool] = None
    truncate: Optional[TokenCount] = None  # keep the prompt's last `truncate` tokens
    top_n_tokens: Optional[TopNTokens] = None
    grammar: Optional[TgiGrammar] = None
    # refused unless left at their "off" values (see _refuse_unimplemented)
    best_of: Optional[int] = None
    watermark: bool = False
    typical_p: Optional[float] = None
    adapter_id: Optional[str] = None


class TgiRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: str
    parameters: TgiParameters = msgspec.field(default_factory=TgiParameters)
    stream: Optional[bool] = None  # POST / (TGI's compat route) streams when true


def tgi_info(cfg: RunConfig) -> dict[str, Any]:
    """GET /info: TGI's Info object, from the run config."""
    m, s = cfg.model, cfg.server
    max_len = m.max_model_len or m.max_position_embeddings
    try:
        version = metadata.version("llaunch")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"model_id": m.name, "model_sha": None, "model_dtype": f"torch.{m.dtype.value}",
            "model_device_type": cfg.device.value, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": cfg.router.max_running_requests * cfg.parallel.dp, "max_best_of": 1,
            "max_stop_sequences": s.max_stop_strings, "max_input_tokens": max_len - 1,
            "max_input_length": max_len - 1, "max_total_tokens": max_len,
            "max_batch_total_tokens": cfg.router.batch_max_tokens, "max_client_batch_size": 1,
            "validation_workers": s.http_workers, "router": "llaunch", "version": version, "sha": None,
            "docker_label": None}


def tgi_error_response(e: ApiError) -> Response:
    return json_response(_error_body(e), status=e.status, headers=e.headers)


def _error_body(e: ApiError) -> dict:
    """TGI's error object; error_type tells huggingface_hub which exception to raise."""
    param = _TGI_PARAM.get(e.param, e.param) if e.param else None
    message = e.message if not param or param in e.message else f"{e.message} (field: {param})"
    kind = ("validation" if 400 <= e.status < 500 else "overloaded" if e.code == "overloaded" else "generation")
    return {"error": message, "error_type": kind}


def _refuse_unimplemented(p: TgiParameters) -> None:
    refused = {"watermark": (p.watermark, "watermarking is not implemented"),
               "best_of": (p.best_of not in (None, 1), "best_of > 1 is not implemented"),
               "typical_p": (p.typical_p is not None, "typical sampling is not implemented"),
               "adapter_id": (p.adapter_id is not None, "LoRA adapters are not served")}
    for name, (asked, why) in refused.items():
        if asked:
            raise bad_request(f"`parameters.{name}`: {why}.", param=f"parameters.{name}")


def _grammar(grammar: Optional[TgiGrammar]) -> dict[str, Any]:
    if grammar is None:
        return {}
    if grammar.type == "json":
        return {"guided_json": grammar.value}
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise bad_request("`parameters.grammar.value` of a regex grammar must be a string (the pattern).",
                              param="parameters.grammar.value")
        return {"regular_constraint": grammar.value}
    raise bad_request(f"`parameters.grammar` of type {grammar.type!r} is not supported: use json (a schema) or "
                      "regex (a pattern).", param="parameters.grammar")


def tgi_jobs(req: TgiRequest, tokenizer: PromptTokenizer, limits: RequestLimits, stream: bool):
    """(prompt ids, engine jobs, seed reported in details) for a TGI request."""
    p = req.parameters
    _refuse_unimplemented(p)
    if p.decoder_input_details and stream:  # TGI's own rule
        raise bad_request("`parameters.decoder_input_details` is not supported when streaming tokens.",
                          param="parameters.decoder_input_details")
    check_prompt_text(req.inputs, limits, param="inputs")
    prompt_ids = tokenizer.encode(req.inputs)
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate:]
    # TGI samples when asked to or when a warper is set (its NextTokenChooser)
    sampling = p.do_sample or p.temperature not in (None, 1.0) or p.top_k is not None or (p.top_p or 1.0) < 1.0
    seed = p.seed if p.seed is not None or not sampling else random.randrange(2**63 - 2**16)  # TGI reports it
    room = limits.max_model_len - len(prompt_ids)
    params = GenerateParameters(
        max_new_tokens=p.max_new_tokens or max(1, min(DEFAULT_MAX_NEW_TOKENS, room)), do_sample=sampling,
        temperature=p.temperature or 1.0, top_p=p.top_p or 1.0, top_k=p.top_k or -1,
        repetition_penalty=p.repetition_penalty or 1.0, frequency_penalty=p.frequency_penalty or 0.0,
        stop_sequences=list(p.stop) or None, seed=seed, return_details=p.details, **_grammar(p.grammar))
    prompt_ids, jobs = generate_jobs(GenerateRequest(inputs=prompt_ids, parameters=params), tokenizer, limits, stream)
    # what TGI returns decides what the engine computes (server.return_all_prompt_logprobs is /generate's
    # LightLLM shape: not this API's)
    top = p.top_n_tokens if p.top_n_tokens and (p.details or stream) else 0
    # TGI's generated_text keeps the stop sequence that ended it
    jobs = [msgspec.structs.replace(j, logprobs=j.logprobs or bool(top), top_logprobs=top,
                                    prompt_logprobs=0 if p.decoder_input_details and p.details else -1,
                                    include_stop_str_in_output=True, stop_token_text=True)
            for j in jobs]
    return prompt_ids, jobs, seed


def _finish_reason(delta: TextDelta) -> Optional[str]:
    """TGI's names: length, eos_token, stop_sequence."""
    if delta.finish_reason not in (None, "stop", "length"):
        raise engine_failed(delta.finish_reason, delta.error)
    if delta.finish_reason == "stop":
        return "stop_sequence" if delta.stopped_by_string else "eos_token"
    return delta.finish_reason


class TgiApi:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.lifecycle = lifecycle

    def _parse(self, body: bytes, stream: Optional[bool]):
        req = decode_body(body, TgiRequest)
        if stream is not None and req.stream not in (None, stream):
            route = "/generate_stream" if req.stream else "/generate"
            raise bad_request(f"`stream` is {str(req.stream).lower()}: POST {route} (or /) for that.", param="stream")
        return req, *tgi_jobs(req, self.tokenizer, self.limits, bool(stream if stream is not None else req.stream))

    async def _submit(self, body: bytes, stream: Optional[bool]):
        req, prompt_ids, jobs, seed = await asyncio.to_thread(self._parse, body, stream)  # tokenizing: off the loop
        group = await self.engine.submit([(prompt_ids, s) for s in jobs], lifecycle=self.lifecycle)
        return req, prompt_ids, seed, group

    def _token(self, token_id: int, logprob: Optional[float], text: str) -> dict:
        return {"id": token_id, "text": text, "logprob": logprob, "special": token_id in self.tokenizer.special_ids}

    def _prefill(self, prompt_ids: list[int], logprobs: list[float]) -> list[dict]:
        """TGI's details.prefill: every prompt token, the first without a logprob (it has no context)."""
        return [{"id": t, "text": self.tokenizer.token_text(t), "logprob": None if i == 0 else logprobs[i - 1]}
                for i, t in enumerate(prompt_ids)]

    def _top(self, delta: TextDelta, k: int) -> list[dict]:
        if k >= len(delta.top_ids):
            return []
        return [self._token(t, lp, self.tokenizer.token_text(t)) for t, lp in zip(delta.top_ids[k], delta.top_logprobs[k])]

    async def compat(self, body: bytes) -> Response:
        """POST /: TGI's compat route: `stream` picks the stream; otherwise a list of one generation."""
        try:
            req, prompt_ids, seed, group = await self._submit(body, None)
            if req.stream:
                return await self._stream(req, len(prompt_ids), seed, group)
            return json_response([await self._generation(req, prompt_ids, seed, group)])
        except ApiError as e:
            return tgi_error_response(e)

    async def generate(self, body: bytes) -> Response:
        try:
            req, prompt_ids, seed, group = await self._submit(body, False)
            return json_response(await self._generation(req, prompt_ids, seed, group))
        except ApiError as e:
            return tgi_error_response(e)

    async def generate_stream(self, body: bytes) -> Response:
        try:
            req, prompt_ids, seed, group = await self._submit(body, True)
            return await self._stream(req, len(prompt_ids), seed, group)
        except ApiError as e:
            return tgi_error_response(e)

    async def _generation(self, req: TgiRequest, prompt_ids: list[int], seed: Optional[int],
                          group: RequestGroup) -> dict:
        p = req.parameters
        texts, tokens, top, finish, prefill = [], [], [], None, []
        try:
            async for _, delta in group:
                if delta.prompt_logprobs is not None:
                    prefill = self._prefill(prompt_ids, delta.prompt_logprobs.logprobs)
                texts.append(delta.text)
                for k, token_id in enumerate(delta.token_ids):
                    logprob = delta.logprobs[k] if k < len(delta.logprobs) else None
                    tokens.append(self._token(token_id, logprob, self.tokenizer.token_text(token_id)))
                    if p.top_n_tokens:
                        top.append(self._top(delta, k))
                finish = _finish_reason(delta) or finish
        finally:
            await group.close()
        out: dict[str, Any] = {"generated_text": (req.inputs if p.return_full_text else "") + "".join(texts)}
        if p.details:
            out["details"] = {"finish_reason": finish, "generated_tokens": len(tokens), "seed": seed, "prefill": prefill,
                              "tokens": tokens, **({"top_tokens": top} if p.top_n_tokens else {})}
        return out

    async def _stream(self, req: TgiRequest, prompt_tokens: int, seed: Optional[int], group: RequestGroup) -> Response:
        await admitted(group)  # a refused request answers with its status, not a 200 stream
        return sse_response(TrackedStream(self._events(req, prompt_tokens, seed, group), group))

    async def _events(self, req: TgiRequest, prompt_tokens: int, seed: Optional[int],
                      group: RequestGroup) -> AsyncIterator[bytes]:
        """One event per token; each is held back until the next arrives, so the last one carries the
        generated text and details (TGI's final event)."""
        p = req.parameters
        pending: Optional[dict] = None
        texts, count = [], 0
        try:
            async for _, delta in group:
                finish = _finish_reason(delta)
                texts.append(delta.text)
                if not delta.token_ids and pending is not None:  # text the detokenizer held back until the end
                    pending["token"]["text"] += delta.text
                for k, token_id in enumerate(delta.token_ids):
                    if pending is not None:
                        yield sse_event(pending, prefix=b"data:")
                    count += 1
                    logprob = delta.logprobs[k] if k < len(delta.logprobs) else None
                    # the delta's text rides on its last token (a token may end mid-character)
                    text = delta.text if k == len(delta.token_ids) - 1 else ""
                    pending = {"index": count, "token": self._token(token_id, logprob, text),
                               "generated_text": None, "details": None}
                    if p.top_n_tokens:
                        pending["top_tokens"] = self._top(delta, k)
                if finish is not None:
                    last = pending or {"index": count, "token": self._token(0, None, ""), "details": None}
                    last["generated_text"] = (req.inputs if p.return_full_text else "") + "".join(texts)
                    if p.details:
                        last["details"] = {"finish_reason": finish, "generated_tokens": count, "seed": seed,
                                           "input_length": prompt_tokens}
                    yield sse_event(last, prefix=b"data:")
                    pending = None
        except Exception as e:  # an engine failure, or a bug: the client still gets the error event
            yield sse_event(_error_body(stream_error(e)), prefix=b"data:")
