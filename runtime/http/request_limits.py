"""Bounds on what one request may ask, in one place for every API (OpenAI, LightLLM's /generate).

Static bounds live in the field types (msgspec `Meta`): a value the worker's tensors cannot hold
(float32, int64) or outside a field's meaning fails decoding with a 400 that names the field, and
the OpenAPI schema carries the same bounds. Bounds that depend on the model or the config
(`server.*` keys: prompts, choices, stop strings; the context length and vocabulary) are
`RequestLimits`, checked before any engine work starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping, Optional

import msgspec

from llaunch.runtime.web.errors import bad_request

INT64_MAX = 2**63 - 1
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
# Temperatures below this sample greedily (vLLM's and LightLLM's epsilon): dividing logits by a
# denormal float32 temperature overflows them.
GREEDY_BELOW = 1e-5

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]  # -1 (or 0 in OpenAI's) is off
Seed = Annotated[int, msgspec.Meta(ge=-INT64_MAX, le=INT64_MAX - MAX_N)]  # seed + choice index fits int64
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=100.0)]
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # the vocabulary is checked against the model
ChoiceCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]  # OpenAI's range
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
Priority = Annotated[int, msgspec.Meta(ge=-2**31, le=2**31 - 1)]  # vLLM's: lower is served first
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TruncateTokens = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]  # vLLM's truncate_prompt_tokens; -1: the context


@dataclass(frozen=True)
class RequestLimits:
    served_name: str
    max_model_len: int
    vocab_size: int
    max_prompts: int = 256
    max_choices: int = 256  # prompts × n
    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    max_constraint_chars: int = 131072  # a structured output's compiled spec (server.max_constraint_chars)
    max_constraint_depth: int = 64  # a JSON schema's nesting of objects and arrays (server.max_constraint_depth)
    # the longest token of the vocabulary, in characters: a prompt text longer than this many
    # characters per context token tokenizes into more tokens than the context holds, so it is
    # refused without being tokenized (PromptTokenizer.max_token_chars)
    max_chars_per_token: int = 64
    # what a request that leaves temperature, top_p, top_k, min_p, repetition_penalty unset gets
    # (model.sampling_defaults, generation_config.json's values included)
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    token_healing: bool = False  # server.token_healing: heal completions' prompts unless a request says
    prompt_logprobs: bool = True  # false under prefill/decode disaggregation: asking for them is a 400
    token_healing_served: bool = True  # false under prefill/decode disaggregation (the prefill side would not heal)
    all_prompt_logprobs: bool = False  # server.return_all_prompt_logprobs: /generate returns them for every request
    ignore_model_name: bool = False  # server.tgi_api: any `model` is this one (TGI serves one model whatever the name)
    trust_request_chat_template: bool = False  # server.trust_request_chat_template: a request's chat_template is rendered
    reasoning_parser: str = "none"  # server.reasoning_parser: how chat answers' <think> blocks are split off

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_chars_per_token


def check_prompt_text(text: str, limits: RequestLimits, param: str = "prompt") -> None:
    """Refuse a text so long it cannot fit the context, before the tokenizer spends seconds on it."""
    if len(text) > limits.max_prompt_chars:
        raise bad_request(f"The prompt has {len(text)} characters: more than this model's context of "
                          f"{limits.max_model_len} tokens can hold.", param=param, code="context_length_exceeded")


def check_token_id(token_id: Any, limits: RequestLimits, param: str) -> None:
    if not (isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < limits.vocab_size):
        raise bad_request(f"Token id {token_id!r} in `{param}` is outside the vocabulary [0, {limits.vocab_size}).",
                          param=param)


def check_stop_strings(stop: list[str], limits: RequestLimits, param: str) -> list[str]:
    """The non-empty stop strings, within the count and length limits."""
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"`{param}` has {len(stop)} stop strings; at most {limits.max_stop_strings} "
                          "(server.max_stop_strings).", param=param)
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"`{param}[{i}]` has {len(s)} characters; at most {limits.max_stop_string_chars} "
                              "(server.max_stop_string_chars).", param=f"{param}[{i}]")
    return [s for s in stop if s]  # an empty stop string would end every request at once


def check_prompt_logprobs(limits: RequestLimits, param: str) -> None:
    if not limits.prompt_logprobs:
        raise bad_request("Prompt logprobs are not served under prefill/decode disaggregation (mode.kind=pd_*).",
                          param=param)


def check_fan_out(prompts: int, n: int, limits: RequestLimits, n_param: str = "n") -> None:
    """One request may start at most max_choices engine requests (prompts × n)."""
    if prompts > limits.max_prompts:
        raise bad_request(f"`prompt` has {prompts} prompts; at most {limits.max_prompts} "
                          "(server.max_prompts_per_request).", param="prompt")
    if prompts * n > limits.max_choices:
        raise bad_request(f"{prompts} prompt(s) × {n} choices is {prompts * n} completions; at most "
                          f"{limits.max_choices} (server.max_choices_per_request).", param=n_param)


def greedy_temperature(temperature: float) -> float:
    """0 for temperatures that sample greedily, else the temperature."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


def max_new_tokens_for(prompt_ids: list[int], max_tokens: Optional[int], param: str, limits: RequestLimits) -> int:
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
