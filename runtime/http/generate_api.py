"""LightLLM's native API: POST /generate and /generate_stream with its request and response shapes
(`lightllm/server/api_lightllm.py`), so LightLLM clients and benchmarks work unchanged."""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, AsyncIterator, Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.http.engine_client import EngineClient, RequestGroup, admitted
from llaunch.runtime.web.errors import ApiError, bad_request, engine_failed, json_response, stream_error
from llaunch.runtime.http.generate_images import MultimodalParams, generate_images
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_logprobs import lightllm_prompt_logprobs
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (MAX_TEMPERATURE, ChoiceCount, RequestLimits, Seed, TokenCount,
                                                 TokenId, TopK, TopP, check_fan_out, check_prompt_text,
                                                 check_stop_strings, check_token_id, greedy_temperature,
                                                 max_new_tokens_for)
from llaunch.runtime.web.sse import TrackedStream, sse_event, sse_response
from llaunch.runtime.http.token_healing import TokenHealer, healed, healing_of
from llaunch.runtime.http.structured_output import constraint_from, one_constraint
from llaunch.runtime.http.unserved_fields import refuse_unserved_lightllm
from llaunch.runtime.ipc.messages import SamplingParams, TextDelta

# LightLLM's own ranges (its SamplingParams.verify): penalties >= 0, repetition >= 1
NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
Repetition = Annotated[float, msgspec.Meta(ge=1.0, le=100.0)]
LightllmTemperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]


class GenerateParameters(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: TokenCount = 16
    min_new_tokens: int = 1
    do_sample: bool = False
    temperature: LightllmTemperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    presence_penalty: NonNegative = 0.0
    frequency_penalty: NonNegative = 0.0
    repetition_penalty: Repetition = 1.0
    ignore_eos: bool = False
    stop_sequences: Union[str, list[Any], None] = None  # str | list[str] | list[list[int]]
    skip_special_tokens: bool = True
    seed: Optional[Seed] = None
    n: Optional[ChoiceCount] = None
    best_of: ChoiceCount = 1
    return_details: bool = False
    # constrained output, LightLLM's names: a regex, an EBNF grammar, a JSON schema; only these tokens
    regular_constraint: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_json: Union[dict[str, Any], str, None] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    token_healing: Optional[bool] = None  # back off the prompt's last token (server.token_healing when unset)
    add_special_tokens: bool = True  # BOS and the like around a text prompt
    add_spaces_between_special_tokens: Optional[bool] = None  # true: added tokens stand apart by a space
    print_eos_token: bool = False  # the eos token's text ends the output (LightLLM leaves it out)
    suggested_dp_index: Optional[int] = None  # the data-parallel replica to run on (out of range: the least loaded)
    image_max_patch_num: int = -1  # InternVL's tiling: the served vision models (Qwen2-VL) have none to bound
    # refused where they would change the result (runtime/http/unserved_fields.py)
    input_penalty: Optional[bool] = None
    exponential_decay_length_penalty: Optional[list[float]] = None
    group_request_id: Optional[int] = None
    move_kv_to_decode_node: Optional[dict[str, Any]] = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: Union[str, list[TokenId]]
    parameters: GenerateParameters = msgspec.field(default_factory=GenerateParameters)
    multimodal_params: Optional[MultimodalParams] = None  # images (Qwen2-VL): runtime/http/generate_images.py


def _stops(spec: Union[str, list[Any], None], tokenizer: PromptTokenizer, limits: RequestLimits):
    """Stop strings and stop token ids; a multi-token id sequence becomes the string it decodes to."""
    items = [spec] if isinstance(spec, str) else (spec or [])
    if len(items) > limits.max_stop_strings:
        raise bad_request(f"stop_sequences has {len(items)} entries; at most {limits.max_stop_strings} "
                          "(server.max_stop_strings).", param="parameters.stop_sequences")
    strings, token_ids = [], []
    for item in items:
        if isinstance(item, str):
            strings += [item] if item else []
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            for t in item:
                check_token_id(t, limits, "parameters.stop_sequences")
            if len(item) == 1:
                token_ids.append(item[0])
            else:
                strings.append(tokenizer.decode(item[:limits.max_stop_string_chars + 1]))
        else:
            raise bad_request("stop_sequences only supports str, list[str], list[list[int]].", param="parameters.stop_sequences")
    return check_stop_strings(strings, limits, "parameters.stop_sequences"), token_ids


def generate_jobs(req: GenerateRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                  stream: bool) -> tuple[list[int], list[SamplingParams]]:
    p = req.parameters
    refuse_unserved_lightllm(p)
    if req.multimodal_params is not None and req.multimodal_params.images:  # GenerateApi splices them first
        raise bad_request("multimodal_params.images: images are not served here.", param="multimodal_params.images")
    n = p.best_of if p.n is None else p.n  # returned: the n of best_of samples with the highest cumulative logprob
    if n > p.best_of:
        raise bad_request(f"n ({n}) must not exceed best_of ({p.best_of}).", param="parameters.n")
    check_fan_out(1, p.best_of, limits, n_param="parameters.best_of")
    if stream and p.best_of != 1:
        raise bad_request("The stream API only supports best_of == 1.", param="parameters.best_of")
    greedy = not p.do_sample or greedy_temperature(p.temperature) == 0.0
    if p.top_k == 0:
        raise bad_request("top_k must be -1 (disable) or at least 1, got 0.", param="parameters.top_k")
    if isinstance(req.inputs, str):
        check_prompt_text(req.inputs, limits, param="inputs")
        prompt_ids = tokenizer.encode(req.inputs) if p.add_special_tokens else tokenizer.encode_plain(req.inputs)
    else:
        prompt_ids = list(req.inputs)
    max_new = max_new_tokens_for(prompt_ids, p.max_new_tokens, "max_new_tokens", limits)
    if not 1 <= p.min_new_tokens <= max_new:  # LightLLM's own range
        raise bad_request(f"min_new_tokens must be in [1, max_new_tokens = {max_new}].",
                          param="parameters.min_new_tokens")
    stop, stop_ids = _stops(p.stop_sequences, tokenizer, limits)
    for t in p.allowed_token_ids or []:
        check_token_id(t, limits, "parameters.allowed_token_ids")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise bad_request("allowed_token_ids must not be empty.", param="parameters.allowed_token_ids")
    sources = [(f"parameters.{name}", constraint_from(kind, value, f"parameters.{name}"))
               for name, kind, value in (("regular_constraint", "regex", p.regular_constraint),
                                         ("guided_grammar", "grammar", p.guided_grammar),
                                         ("guided_json", "json", p.guided_json)) if value is not None]
    constraint = one_constraint(sources, limits) if sources else None
    jobs = []
    for i in range(p.best_of):
        jobs.append(SamplingParams(
            max_new_tokens=max_new, temperature=0.0 if greedy else p.temperature,
            top_p=1.0 if greedy else p.top_p, top_k=-1 if greedy or p.top_k >= limits.vocab_size else p.top_k,
            seed=None if p.seed is None else p.seed + i, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            ignore_eos=p.ignore_eos, stop=stop, stop_token_ids=stop_ids, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=bool(p.add_spaces_between_special_tokens), stop_token_text=p.print_eos_token,
            # LightLLM reports each token's logprob in streams and details.
            # best_of > n ranks the samples by their cumulative logprob
            logprobs=stream or p.return_details or p.best_of > n,
            min_tokens=p.min_new_tokens if p.min_new_tokens > 1 else 0,
            allowed_ids=list(dict.fromkeys(p.allowed_token_ids or [])), constraint=constraint,
            # server.return_all_prompt_logprobs: LightLLM returns them from /generate (not streamed),
            # once per response: the first sample computes them
            prompt_logprobs=0 if limits.all_prompt_logprobs and not stream and i == 0 else -1))
    return prompt_ids, jobs


def _finish(delta: TextDelta) -> Optional[str]:
    if delta.finish_reason not in (None, "stop", "length"):
        raise engine_failed(delta.finish_reason, delta.error)
    return delta.finish_reason


class GenerateApi:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle,
                 images: Optional[ImageInputs] = None):
        self.images = images  # a Qwen2-VL model's: multimodal_params.images
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.lifecycle = lifecycle
        self.healer = TokenHealer(tokenizer)

    async def _submit(self, body: bytes, stream: bool) -> tuple[GenerateRequest, list[int], RequestGroup]:
        req, prompt_ids, jobs, images = await asyncio.to_thread(self._parse, body, stream)  # tokenizing: off the loop
        group = await self.engine.submit([(prompt_ids, s) for s in jobs], lifecycle=self.lifecycle, images=images,
                                         replica=req.parameters.suggested_dp_index)
        return req, prompt_ids, group

    def _parse(self, body: bytes, stream: bool):
        req = decode_body(body, GenerateRequest)
        if req.multimodal_params is not None and req.multimodal_params.images:
            return self._parse_images(req, stream)
        prompt_ids, jobs = generate_jobs(req, self.tokenizer, self.limits, stream)
        healing = healing_of(self.healer, prompt_ids, req.parameters.token_healing, self.limits, jobs,
                             "parameters.token_healing")
        if healing is None:
            return req, prompt_ids, jobs, []
        return req, healing.prompt_ids, [healed(j, healing) for j in jobs], []

    def _parse_images(self, req: GenerateRequest, stream: bool):
        """The prompt with its images spliced in; its other checks run on it with each image token as the
        placeholder it stands for (as the chat path does)."""
        if isinstance(req.inputs, str):
            check_prompt_text(req.inputs, self.limits, param="inputs")
        text_ids = self.tokenizer.encode(req.inputs) if isinstance(req.inputs, str) else list(req.inputs)
        for t in text_ids:  # ids past the vocabulary stand for images below: a client's own would reach the model
            check_token_id(t, self.limits, "inputs")
        prompt_ids, images = generate_images(self.images, req.multimodal_params, text_ids)
        if req.parameters.token_healing:
            raise bad_request("token_healing is not supported with images.", param="parameters.token_healing")
        if self.limits.all_prompt_logprobs:
            raise bad_request("multimodal_params.images: prompt logprobs (server.return_all_prompt_logprobs) are "
                              "not supported with images.", param="multimodal_params.images")
        checked = [t if t < self.limits.vocab_size else self.images.image_token_id for t in prompt_ids]
        _, jobs = generate_jobs(msgspec.structs.replace(req, inputs=checked, multimodal_params=None), self.tokenizer,
                                self.limits, stream)
        return req, prompt_ids, jobs, images

    def _token(self, token_id: Optional[int], logprob: Optional[float], count: int, prompt_tokens: int) -> dict:
        return {"id": token_id, "logprob": logprob,
                "special": token_id is not None and token_id in self.tokenizer.special_ids,
                "count_output_tokens": count, "prompt_tokens": prompt_tokens}

    async def generate(self, body: bytes) -> Response:
        req, prompt_ids, group = await self._submit(body, stream=False)
        prompt_tokens, prompt_logprobs = len(prompt_ids), None
        n = len(group.request_ids)
        texts, counts, finish = [[] for _ in range(n)], [0] * n, [None] * n
        details, cum = [[] for _ in range(n)], [0.0] * n
        try:
            async for i, delta in group:
                texts[i].append(delta.text)
                if delta.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = delta.prompt_logprobs
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
        p = req.parameters
        if p.n is not None and p.n < n:  # best_of: the n samples of the highest cumulative logprob, best first
            keep = sorted(range(n), key=lambda i: -cum[i])[:p.n]
            texts, counts, finish, details = ([values[i] for i in keep] for values in (texts, counts, finish, details))
            n = p.n
        one = (lambda values: values[0]) if n == 1 else (lambda values: values)  # LightLLM unwraps n == 1
        out = {"generated_text": ["".join(t) for t in texts], "count_output_tokens": one(counts),
               "finish_reason": one(finish), "prompt_tokens": prompt_tokens}
        if req.parameters.return_details:
            out["tokens"] = one(details)
        if prompt_logprobs is not None:
            out["prompt_token_ids"] = prompt_ids
            out["prompt_logprobs"] = lightllm_prompt_logprobs(prompt_ids, prompt_logprobs)
        return json_response(out)

    async def generate_stream(self, body: bytes) -> Response:
        _, prompt_ids, group = await self._submit(body, stream=True)
        await admitted(group)  # a refused request answers with its status, not a 200 stream
        return sse_response(TrackedStream(self._events(group, len(prompt_ids)), group))

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
        except Exception as e:  # an engine failure, or a bug: the client still gets the error event
            yield sse_event(stream_error(e).body(), prefix=b"data:")
