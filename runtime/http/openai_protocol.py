"""OpenAI request bodies: decode with msgspec (wrong types fail with the field's path), validate every
value against the model's limits, and turn each choice into engine work (prompt ids + SamplingParams).

Fields are Optional because clients send explicit nulls; unknown fields are ignored, as OpenAI does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Type, TypeVar, Union

import msgspec

from llaunch.runtime.http.errors import bad_request, model_not_found
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.ipc.messages import SamplingParams

MAX_N = 16
MAX_TOP_LOGPROBS = 20

R = TypeVar("R")


class StreamOptions(msgspec.Struct):
    include_usage: Optional[bool] = None


class _GenerationRequest(msgspec.Struct, kw_only=True):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    n: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    return_token_ids: Optional[bool] = None  # vLLM's extension: choices carry the generated token ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: Union[str, list[Any]]  # str | list[int] | list[str] | list[list[int]]: checked below
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(msgspec.Struct):
    type: str
    text: Optional[str] = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None  # the newer name of max_tokens
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class ModelLimits:
    served_name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Choice:
    """One engine request: choice `index` of the response, sampled from `prompt_ids`."""

    index: int
    prompt: int  # which prompt of the request (several choices share one)
    prompt_ids: list[int]
    sampling: SamplingParams


def decode_body(body: bytes, request_type: Type[R]) -> R:
    if not body:
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as e:
        raise bad_request(f"Invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"The body is not valid JSON: {e}") from None


def _param_of(message: str) -> Optional[str]:
    """The field a msgspec error names: "... - at `$.messages[0].role`", "missing required field `x`"."""
    path = message.rsplit("at `$.", 1)[1].split("`", 1)[0] if "at `$." in message else None
    missing = message.split("required field `", 1)[1].split("`", 1)[0] if "required field `" in message else None
    if missing:
        return f"{path}.{missing}" if path else missing
    return path


def check_model(requested: Optional[str], limits: ModelLimits) -> None:
    if requested is not None and requested != limits.served_name:
        raise model_not_found(requested)


def completion_prompts(req: CompletionRequest, tokenizer: PromptTokenizer) -> list[list[int]]:
    """A string, a list of token ids, or a list of either: one id list per prompt."""
    p = req.prompt
    if isinstance(p, str):
        return [tokenizer.encode(p)]
    if p and all(_is_token_id(t) for t in p):
        return [list(p)]
    if p and all(isinstance(x, str) for x in p):
        return [tokenizer.encode(x) for x in p]
    if p and all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p):
        return [list(x) for x in p]
    raise bad_request("`prompt` must be a string, a list of token ids, or a non-empty list of either.",
                      param="prompt")


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chat_prompt(req: ChatCompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    if not req.messages:
        raise bad_request("`messages` must not be empty.", param="messages")
    if req.tools:
        raise bad_request("Tool calls are not supported.", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("Only `response_format` of type `text` is supported.", param="response_format")
    if not tokenizer.has_chat_template:
        raise bad_request("The served model's tokenizer has no chat template; use /v1/completions.")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of system, developer, user, "
                              "assistant, tool.", param=f"messages[{i}].role")
        messages.append({"role": m.role, "content": _message_text(m, i)})
    try:
        return tokenizer.encode_chat(messages)
    except Exception as e:  # the template itself may reject an order of roles
        raise bad_request(f"The chat template rejected the messages: {e}", param="messages") from None


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{i}]: only text content parts are supported, got {part.type!r}.",
                              param=f"messages[{i}].content")
        parts.append(part.text)
    return "".join(parts)


def completion_choices(req: CompletionRequest, prompts: list[list[int]], limits: ModelLimits) -> list[Choice]:
    if req.suffix:
        raise bad_request("`suffix` is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("`best_of` must equal `n`.", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}.", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise bad_request("`echo` with `logprobs` needs prompt logprobs, which are not supported.", param="echo")
    want_logprobs = req.logprobs is not None
    return _choices(req, prompts, limits, req.max_tokens, "max_tokens", want_logprobs, req.logprobs or 0)


def chat_choices(req: ChatCompletionRequest, prompt_ids: list[int], limits: ModelLimits) -> list[Choice]:
    top = req.top_logprobs
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {top}.", param="top_logprobs")
        if top > 0 and not req.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    return _choices(req, [prompt_ids], limits, max_tokens, param, bool(req.logprobs), top or 0)


def _choices(req: _GenerationRequest, prompts: list[list[int]], limits: ModelLimits,
             max_tokens: Optional[int], max_tokens_param: str, logprobs: bool, top_logprobs: int) -> list[Choice]:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"`n` must be in [1, {MAX_N}], got {n}.", param="n")
    base = _sampling_fields(req)
    choices = []
    for p, prompt_ids in enumerate(prompts):
        new_tokens = max_new_tokens_for(prompt_ids, max_tokens, max_tokens_param, limits)
        for i in range(n):
            seed = None if req.seed is None else req.seed + i  # distinct samples, reproducible
            sampling = SamplingParams(max_new_tokens=new_tokens, seed=seed, logprobs=logprobs,
                                      top_logprobs=top_logprobs, **base)
            choices.append(Choice(index=p * n + i, prompt=p, prompt_ids=prompt_ids, sampling=sampling))
    for token_id in base["stop_token_ids"]:
        check_token_id(token_id, limits, "stop_token_ids")
    return choices


def _sampling_fields(req: _GenerationRequest) -> dict:
    if req.logit_bias:
        raise bad_request("`logit_bias` is not supported.", param="logit_bias")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise bad_request(f"`temperature` must be >= 0, got {temperature}.", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise bad_request(f"`top_p` must be in (0, 1], got {top_p}.", param="top_p")
    top_k = -1 if req.top_k in (None, 0) else req.top_k  # 0 and -1 both mean: no top-k
    if top_k < -1:
        raise bad_request(f"`top_k` must be -1 (off) or >= 1, got {top_k}.", param="top_k")
    fields = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    for name, default, low, high in (("presence_penalty", 0.0, -2.0, 2.0), ("frequency_penalty", 0.0, -2.0, 2.0)):
        value = getattr(req, name)
        value = default if value is None else value
        if not low <= value <= high:
            raise bad_request(f"`{name}` must be in [{low}, {high}], got {value}.", param=name)
        fields[name] = value
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if repetition <= 0:
        raise bad_request(f"`repetition_penalty` must be > 0, got {repetition}.", param="repetition_penalty")
    fields["repetition_penalty"] = repetition
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    fields["stop"] = [s for s in stop if s]  # an empty stop string would end every request at once
    fields["stop_token_ids"] = list(req.stop_token_ids or [])
    fields["ignore_eos"] = bool(req.ignore_eos)
    fields["skip_special_tokens"] = True if req.skip_special_tokens is None else req.skip_special_tokens
    return fields


def max_new_tokens_for(prompt_ids: list[int], max_tokens: Optional[int], param: str, limits: ModelLimits) -> int:
    if not prompt_ids:
        raise bad_request("The prompt is empty.", param="prompt")
    for token_id in prompt_ids:
        check_token_id(token_id, limits, "prompt")
    room = limits.max_model_len - len(prompt_ids)
    if max_tokens is None:
        if room <= 0:
            raise bad_request(f"This model's maximum context length is {limits.max_model_len} tokens, but the "
                              f"prompt has {len(prompt_ids)} tokens, leaving no room for a completion.",
                              param="prompt", code="context_length_exceeded")
        return room
    if max_tokens <= 0:
        raise bad_request(f"`{param}` must be at least 1, got {max_tokens}.", param=param)
    if max_tokens > room:
        raise bad_request(f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                          f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                          f"{max_tokens} for the completion).", param=param, code="context_length_exceeded")
    return max_tokens


def check_token_id(token_id: int, limits: ModelLimits, param: str) -> None:
    if not 0 <= token_id < limits.vocab_size:
        raise bad_request(f"Token id {token_id} in `{param}` is outside the vocabulary [0, {limits.vocab_size}).",
                          param=param)

