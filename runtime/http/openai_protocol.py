"""OpenAI request bodies: decode with msgspec (wrong types and out-of-range values fail with the
field's path), validate every value against the model's and the server's limits
(runtime/http/request_limits.py), and turn each choice into engine work (prompt ids + SamplingParams).

Fields are Optional because clients send explicit nulls. A field llaunch does not implement is
refused with a 400 naming it (never silently ignored); `user` and `metadata` are accepted and unused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Type, TypeVar, Union

import msgspec

from llaunch.runtime.http.errors import bad_request, model_not_found
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (ChoiceCount, Penalty, RepetitionPenalty, RequestLimits, Seed,
                                                 Temperature, TokenCount, TokenId, TopK, TopLogprobs, TopP,
                                                 check_fan_out, check_prompt_text, check_stop_strings,
                                                 check_token_id, greedy_temperature, max_new_tokens_for)
from llaunch.runtime.ipc.messages import SamplingParams

R = TypeVar("R")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: Optional[bool] = None


class _GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Optional[str] = None
    max_tokens: Optional[TokenCount] = None
    n: Optional[ChoiceCount] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    seed: Optional[Seed] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # accepted, unused
    metadata: Optional[dict[str, str]] = None  # accepted, unused
    return_token_ids: Optional[bool] = None  # vLLM's extension: choices carry the generated token ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    prompt: Union[str, list[Any]]  # str | list[int] | list[str] | list[list[int]]: checked below
    logprobs: Optional[TopLogprobs] = None
    echo: Optional[bool] = None
    best_of: Optional[ChoiceCount] = None
    suffix: Optional[str] = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: Optional[str] = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    max_completion_tokens: Optional[TokenCount] = None  # the newer name of max_tokens
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


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
    except RecursionError:
        raise bad_request("The request body nests arrays or objects too deeply.") from None


def _param_of(message: str) -> Optional[str]:
    """The field a msgspec error names: "... - at `$.messages[0].role`", "missing required field `x`",
    "Object contains unknown field `x`"."""
    path = message.rsplit("at `$.", 1)[1].split("`", 1)[0] if "at `$." in message else None
    for marker in ("required field `", "unknown field `"):
        if marker in message:
            name = message.split(marker, 1)[1].split("`", 1)[0]
            return f"{path}.{name}" if path else name
    return path


def check_model(requested: Optional[str], limits: RequestLimits) -> None:
    if requested is not None and requested != limits.served_name:
        raise model_not_found(requested)


def completion_prompts(req: CompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> list[list[int]]:
    """A string, a list of token ids, or a list of either: one id list per prompt. Every text is
    checked against the context before it is tokenized, and the count against the fan-out limit."""
    p = req.prompt
    if isinstance(p, str):
        check_prompt_text(p, limits)
        return [tokenizer.encode(p)]
    if p and all(_is_token_id(t) for t in p):
        return [list(p)]
    if p and all(isinstance(x, str) for x in p):
        check_fan_out(len(p), req.n or 1, limits)
        for x in p:
            check_prompt_text(x, limits)
        return [tokenizer.encode(x) for x in p]
    if p and all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p):
        check_fan_out(len(p), req.n or 1, limits)
        return [list(x) for x in p]
    raise bad_request("`prompt` must be a string, a list of token ids, or a non-empty list of either.",
                      param="prompt")


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chat_prompt(req: ChatCompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> list[int]:
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
    check_prompt_text("".join(m["content"] for m in messages), limits, param="messages")
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


def completion_choices(req: CompletionRequest, prompts: list[list[int]], limits: RequestLimits) -> list[Choice]:
    if req.suffix:
        raise bad_request("`suffix` is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("`best_of` must equal `n`.", param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("`echo` with `logprobs` needs prompt logprobs, which are not supported.", param="echo")
    want_logprobs = req.logprobs is not None
    return _choices(req, prompts, limits, req.max_tokens, "max_tokens", want_logprobs, req.logprobs or 0)


def chat_choices(req: ChatCompletionRequest, prompt_ids: list[int], limits: RequestLimits) -> list[Choice]:
    top = req.top_logprobs
    if top is not None and top > 0 and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    return _choices(req, [prompt_ids], limits, max_tokens, param, bool(req.logprobs), top or 0)


def _choices(req: _GenerationRequest, prompts: list[list[int]], limits: RequestLimits,
             max_tokens: Optional[int], max_tokens_param: str, logprobs: bool, top_logprobs: int) -> list[Choice]:
    n = 1 if req.n is None else req.n
    check_fan_out(len(prompts), n, limits)
    base = _sampling_fields(req, limits)
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


def _sampling_fields(req: _GenerationRequest, limits: RequestLimits) -> dict:
    if req.logit_bias:
        raise bad_request("`logit_bias` is not supported.", param="logit_bias")
    temperature = greedy_temperature(1.0 if req.temperature is None else req.temperature)
    top_k = -1 if req.top_k in (None, 0) else req.top_k  # 0 and -1 both mean: no top-k
    fields = dict(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                  top_k=-1 if top_k >= limits.vocab_size else top_k,  # the whole vocabulary: no top-k
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    fields["stop"] = check_stop_strings(stop, limits, "stop")
    if len(req.stop_token_ids or []) > limits.max_stop_strings:
        raise bad_request(f"`stop_token_ids` has {len(req.stop_token_ids)} ids; at most {limits.max_stop_strings} "
                          "(server.max_stop_strings).", param="stop_token_ids")
    fields["stop_token_ids"] = list(req.stop_token_ids or [])
    fields["ignore_eos"] = bool(req.ignore_eos)
    fields["skip_special_tokens"] = True if req.skip_special_tokens is None else req.skip_special_tokens
    return fields
