"""LightLLM's native API: POST /generate and /generate_stream with its request and response shapes
(`lightllm/server/api_lightllm.py`), so LightLLM clients and benchmarks work unchanged."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.http.engine_client import EngineClient, RequestGroup
from llaunch.runtime.http.errors import ApiError, bad_request, engine_failed, json_response
from llaunch.runtime.http.lifecycle import Lifecycle
from llaunch.runtime.http.openai_protocol import MAX_N, ModelLimits, check_token_id, decode_body, max_new_tokens_for
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.sse import TrackedStream, sse_event, sse_response
from llaunch.runtime.ipc.messages import SamplingParams, TextDelta

_GREEDY_TEMPERATURE = 1e-5  # LightLLM: a sampling temperature below this means greedy


class GenerateParameters(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 16
    min_new_tokens: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_sequences: Union[str, list[Any], None] = None  # str | list[str] | list[list[int]]
    skip_special_tokens: bool = True
    seed: Optional[int] = None
    n: Optional[int] = None
    best_of: int = 1
    return_details: bool = False


class GenerateRequest(msgspec.Struct):
    inputs: Union[str, list[int]]
    parameters: GenerateParameters = msgspec.field(default_factory=GenerateParameters)


def _stops(spec: Union[str, list[Any], None], tokenizer: PromptTokenizer, limits: ModelLimits):
    """Stop strings and stop token ids; a multi-token id sequence becomes the string it decodes to."""
    items = [spec] if isinstance(spec, str) else (spec or [])
    strings, token_ids = [], []
    for item in items:
        if isinstance(item, str):
            strings += [item] if item else []
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            for t in item:
                check_token_id(t, limits, "stop_sequences")
            if len(item) == 1:
                token_ids.append(item[0])
            else:
                strings.append(tokenizer.decode(item))
        else:
            raise bad_request("stop_sequences only supports str, list[str], list[list[int]].", param="stop_sequences")
    return strings, token_ids


def generate_jobs(req: GenerateRequest, tokenizer: PromptTokenizer, limits: ModelLimits,
                  stream: bool) -> tuple[list[int], list[SamplingParams]]:
    p = req.parameters
    n = p.best_of if p.n is None else p.n
    if n != p.best_of:
        raise bad_request("Only n == best_of is supported.", param="n")
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {n}.", param="n")
    if stream and n != 1:
        raise bad_request("The stream API only supports best_of == 1.", param="best_of")
    if p.min_new_tokens != 1:
        raise bad_request("min_new_tokens other than 1 is not supported.", param="min_new_tokens")
    greedy = not p.do_sample or 0.0 <= p.temperature < _GREEDY_TEMPERATURE
    checks = [(p.presence_penalty >= 0, "presence_penalty", "must be >= 0.0"),
              (p.frequency_penalty >= 0, "frequency_penalty", "must be >= 0.0"),
              (p.repetition_penalty >= 1, "repetition_penalty", "must be >= 1.0"),
              (greedy or p.temperature > 0, "temperature", "must be > 0.0"),
              (0 < p.top_p <= 1, "top_p", "must be in (0.0, 1.0]"),
              (p.top_k == -1 or p.top_k >= 1, "top_k", "must be -1 (disable) or at least 1")]
    for ok, name, rule in checks:
        if not ok:
            raise bad_request(f"{name} {rule}, got {getattr(p, name)}.", param=name)
    prompt_ids = tokenizer.encode(req.inputs) if isinstance(req.inputs, str) else list(req.inputs)
    max_new = max_new_tokens_for(prompt_ids, p.max_new_tokens, "max_new_tokens", limits)
    stop, stop_ids = _stops(p.stop_sequences, tokenizer, limits)
    jobs = []
    for i in range(n):
        jobs.append(SamplingParams(
            max_new_tokens=max_new, temperature=0.0 if greedy else p.temperature,
            top_p=1.0 if greedy else p.top_p, top_k=-1 if greedy else p.top_k,
            seed=None if p.seed is None else p.seed + i, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            ignore_eos=p.ignore_eos, stop=stop, stop_token_ids=stop_ids, skip_special_tokens=p.skip_special_tokens,
            # LightLLM reports each token's logprob in streams and details.
            logprobs=stream or p.return_details))
    return prompt_ids, jobs


def _finish(delta: TextDelta) -> Optional[str]:
    if delta.finish_reason not in (None, "stop", "length"):
        raise engine_failed(delta.finish_reason)
    return delta.finish_reason


class GenerateApi:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: ModelLimits, lifecycle: Lifecycle):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.lifecycle = lifecycle

    async def _submit(self, body: bytes, stream: bool) -> tuple[GenerateRequest, int, RequestGroup]:
        req = decode_body(body, GenerateRequest)
        prompt_ids, jobs = generate_jobs(req, self.tokenizer, self.limits, stream)
        return req, len(prompt_ids), await self.engine.submit([(prompt_ids, s) for s in jobs], lifecycle=self.lifecycle)

    def _token(self, token_id: Optional[int], logprob: Optional[float], count: int, prompt_tokens: int) -> dict:
        return {"id": token_id, "logprob": logprob,
                "special": token_id is not None and token_id in self.tokenizer.special_ids,
                "count_output_tokens": count, "prompt_tokens": prompt_tokens}

    async def generate(self, body: bytes) -> Response:
        req, prompt_tokens, group = await self._submit(body, stream=False)
        n = len(group.request_ids)
        texts, counts, finish = [[] for _ in range(n)], [0] * n, [None] * n
        details, cum = [[] for _ in range(n)], [0.0] * n
        try:
            async for i, delta in group:
                texts[i].append(delta.text)
                for k, token_id in enumerate(delta.token_ids):
                    counts[i] += 1
                    logprob = delta.logprobs[k] if k < len(delta.logprobs) else None
                    cum[i] += logprob or 0.0
                    token = self._token(token_id, logprob, counts[i], prompt_tokens)
                    token.update(text=self.tokenizer.token_text(token_id), cumlogprob=cum[i] / counts[i])
                    details[i].append(token)
                finish[i] = _finish(delta)
        finally:
            await group.close()
        one = (lambda values: values[0]) if n == 1 else (lambda values: values)  # LightLLM unwraps n == 1
        out = {"generated_text": ["".join(t) for t in texts], "count_output_tokens": one(counts),
               "finish_reason": one(finish), "prompt_tokens": prompt_tokens}
        if req.parameters.return_details:
            out["tokens"] = one(details)
        return json_response(out)

    async def generate_stream(self, body: bytes) -> Response:
        _, prompt_tokens, group = await self._submit(body, stream=True)
        return sse_response(TrackedStream(self._events(group, prompt_tokens), group))

    async def _events(self, group: RequestGroup, prompt_tokens: int) -> AsyncIterator[bytes]:
        count = 0
        try:
            async for _, delta in group:
                finish = _finish(delta)
                # One event per token as LightLLM sends; the delta's text rides on its last token.
                steps = list(enumerate(delta.token_ids)) or [(0, None)]
                for k, token_id in steps:
                    last = k == len(steps) - 1
                    count += token_id is not None
                    logprob = delta.logprobs[k] if k < len(delta.logprobs) else None
                    token = self._token(token_id, logprob, count, prompt_tokens)
                    token["text"] = delta.text if last else ""
                    yield sse_event({"token": token, "generated_text": None, "finished": last and finish is not None,
                                     "finish_reason": finish if last else None, "details": None}, prefix=b"data:")
        except ApiError as e:
            yield sse_event(e.body(), prefix=b"data:")
