"""OpenAI request bodies: msgspec types decoded by runtime/web/request_body.py (wrong types and
out-of-range values fail with the field's path), validate every value against the model's and the server's limits
(runtime/http/request_limits.py), and turn each choice into engine work (prompt ids + SamplingParams).

Fields are Optional because clients send explicit nulls. A field llaunch does not implement is
refused with a 400 naming it (never silently ignored); `user` and `metadata` are accepted and unused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec

from llaunch.runtime.http.chat_messages import chat_messages, content_text, template_options
from llaunch.runtime.web.errors import bad_request, model_not_found
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (MAX_LOGIT_BIAS, ChoiceCount, LogitBias, MinTokens, Penalty,
                                                 Priority, Probability, RepetitionPenalty, RequestId, RequestLimits,
                                                 Seed, Temperature, TokenCount, TokenId, TopK, TopLogprobs, TopP,
                                                 TruncateTokens, check_fan_out, check_prompt_logprobs,
                                                 check_prompt_text, check_stop_strings, check_token_id,
                                                 greedy_temperature, max_new_tokens_for)
from llaunch.runtime.http.structured_output import one_constraint, openai_sources
from llaunch.runtime.http.tool_calls import tools_constraint
from llaunch.runtime.http.unserved_fields import refuse_unserved
from llaunch.runtime.ipc.messages import Constraint, SamplingParams


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: with include_usage, every chunk carries usage so far
    include_obfuscation: Optional[bool] = None  # OpenAI's padding against length side channels: accepted, none added


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Optional[str] = None
    description: Optional[str] = None
    schema: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema; vLLM's structural_tag; TGI's json | regex (with `value`)
    json_schema: Optional[JsonSchemaFormat] = None
    value: Union[dict[str, Any], str, None] = None  # TGI's grammar: a schema, a pattern, or {name, schema}
    structures: Optional[list[dict[str, Any]]] = None  # vLLM's structural_tag: [{begin, schema, end}] ...
    triggers: Optional[list[str]] = None  # ... each starting after one of these
    format: Optional[dict[str, Any]] = None  # xgrammar's own structural tag format


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra: one of these."""

    json: Union[dict[str, Any], str, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


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
    include_stop_str_in_output: Optional[bool] = None  # vLLM's extension: the matched stop string is returned
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # token id (a string, as JSON keys are) → bias; TGI's list (which TGI ignores) is refused
    logit_bias: Union[dict[str, LogitBias], list[Any], None] = None
    min_p: Optional[Probability] = None
    min_tokens: Optional[MinTokens] = None
    bad_words: Optional[list[str]] = None  # never generated (vLLM's extension)
    allowed_token_ids: Optional[list[TokenId]] = None  # only these are generated (vLLM's extension)
    # structured output: OpenAI's response_format, or one of vLLM's extensions
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # only "xgrammar" (or unset)
    user: Optional[str] = None  # accepted, unused
    metadata: Optional[dict[str, str]] = None  # accepted, unused
    return_token_ids: Optional[bool] = None  # vLLM's extension: choices carry the generated token ids
    prompt_logprobs: Optional[TopLogprobs] = None  # vLLM's extension: each prompt token's logprob, plus this many top
    # vLLM's extensions
    priority: Optional[Priority] = None  # lower is served first (the router's wait queue; FCFS within one)
    request_id: Optional[RequestId] = None  # the response's id is `chatcmpl-<it>` / `cmpl-<it>`
    add_special_tokens: Optional[bool] = None  # BOS and the like around the prompt (completions: yes; chat: no)
    truncate_prompt_tokens: Optional[TruncateTokens] = None  # keep only the prompt's last k tokens (-1: the context)
    spaces_between_special_tokens: Optional[bool] = None  # true: added tokens stand apart by a space in the text
    return_tokens_as_token_ids: Optional[bool] = None  # logprobs name tokens "token_id:<id>"
    structural_tag: Optional[str] = None  # structured output: vLLM's structural tag (JSON)
    do_sample: Optional[bool] = None  # LightLLM's: false samples greedily whatever the temperature
    # refused where set (runtime/http/unserved_fields.py says why)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    logits_processors: Optional[list[Any]] = None
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    guided_whitespace_pattern: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage in every chunk (only with include_usage, as vLLM)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    prompt: Union[str, list[Any]]  # str | list[int] | list[str] | list[list[int]]: checked below
    logprobs: Optional[TopLogprobs] = None
    echo: Optional[bool] = None
    best_of: Optional[ChoiceCount] = None  # samples per prompt; the n with the highest cumulative logprob return
    suffix: Optional[str] = None
    token_healing: Optional[bool] = None  # back off the prompt's last token (server.token_healing when unset)
    prompt_embeds: Union[str, list[Any], None] = None  # vLLM's: refused


class ImageUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    detail: Optional[str] = None  # auto | high (the model's own resolution); low is refused


class InputAudio(msgspec.Struct, forbid_unknown_fields=True):
    data: str  # base64
    format: str  # wav, flac, mp3, ogg (runtime/http/audio_decode.py FORMATS); others: 400


class AudioUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: str  # a base64 data: URL; http(s) is refused


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: Optional[str] = None
    image_url: Optional[ImageUrl] = None  # type image_url: multimodal models (runtime/http/images.py)
    input_audio: Optional[InputAudio] = None  # type input_audio: audio models (runtime/http/audio.py)
    audio_url: Optional[AudioUrl] = None  # type audio_url: audio models


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str  # system | developer | user | assistant | tool | function (OpenAI's older tool turn)
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool turn: which call it answers
    function_call: Optional[FunctionCall] = None  # an assistant turn that called a function (OpenAI's older form)
    refusal: Optional[str] = None  # an assistant turn's refusal: the template takes content only
    reasoning_content: Optional[str] = None  # an earlier answer's thoughts (vLLM's): the chat template decides their use
    reasoning: Optional[str] = None
    audio: Optional[dict[str, Any]] = None  # an earlier audio answer: refused (no audio output is served)


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # function
    function: FunctionDefinition


class ChatCompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    max_completion_tokens: Optional[TokenCount] = None  # the newer name of max_tokens
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[FunctionDefinition]] = None  # OpenAI's older tools: one call, as `function_call`
    function_call: Union[str, dict[str, Any], None] = None  # none | auto | {"name": ...}
    best_of: Optional[ChoiceCount] = None  # vLLM's: samples; the n of the highest cumulative logprob return
    # the chat template (vLLM's extensions; LightLLM's role_settings / character_settings; TGI's tool_prompt)
    echo: Optional[bool] = None  # the last message, when it is the assistant's, leads the answer
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None  # the answer continues the last (assistant) message
    documents: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None  # server.trust_request_chat_template
    chat_template_kwargs: Optional[dict[str, Any]] = None
    role_settings: Optional[dict[str, Any]] = None
    character_settings: Optional[list[dict[str, Any]]] = None
    tool_prompt: Optional[str] = None
    # OpenAI's, accepted without effect: storage, billing, caching and safety hints, a reasoning
    # effort (the served models do not reason)
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    include_reasoning: Optional[bool] = None  # vLLM's
    verbosity: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    # a predicted output: text spec=ngram's lookup searches after the prompt (runtime/http/predicted_output.py)
    prediction: Optional[dict[str, Any]] = None
    # refused where set (runtime/http/unserved_fields.py says why)
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    moderation: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Optional[dict[str, Any]] = None
    token_healing: Optional[bool] = None  # llaunch's completions field: a chat prompt is never healed


@dataclass(frozen=True)
class Choice:
    """One engine request: choice `index` of the response, sampled from `prompt_ids`."""

    index: int
    prompt: int  # which prompt of the request (several choices share one)
    prompt_ids: list[int]
    sampling: SamplingParams


def check_model(requested: Optional[str], limits: RequestLimits) -> None:
    """A 404 for another model's name, unless names are ignored (server.tgi_api: as TGI, where
    huggingface_hub's InferenceClient sends `dummy`)."""
    if requested is not None and requested != limits.served_name and not limits.ignore_model_name:
        raise model_not_found(requested)


def adopt_functions(req: ChatCompletionRequest) -> None:
    """OpenAI's older `functions` / `function_call`, served as tools with one call at most (the
    answer then carries `function_call`, not `tool_calls`: runtime/http/openai_serving.py)."""
    fc = req.function_call
    if not req.functions:
        if fc not in (None, "none", "auto"):  # LightLLM's chat sends "none"
            raise bad_request("`function_call` names a function but no `functions` are given.", param="function_call")
        return
    if req.tools:
        raise bad_request("Give `tools` or `functions`, not both.", param="functions")
    if isinstance(fc, dict):
        fc = {"type": "function", "function": {"name": fc.get("name")}}
    elif fc not in (None, "none", "auto"):
        raise bad_request(f"function_call {fc!r} is not one of none, auto or {{\"name\": ...}}.", param="function_call")
    req.tools = [Tool(type="function", function=f) for f in req.functions]
    req.tool_choice, req.parallel_tool_calls = fc or "auto", False


def truncated(prompt_ids: list[int], keep: Optional[int], limits: RequestLimits) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return prompt_ids
    if keep == 0:
        raise bad_request("`truncate_prompt_tokens` must be at least 1, or -1 for the context.",
                          param="truncate_prompt_tokens")
    keep = limits.max_model_len if keep == -1 else keep
    return prompt_ids[-keep:]


def completion_prompts(req: CompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> list[list[int]]:
    """A string, a list of token ids, or a list of either: one id list per prompt. Every text is
    checked against the context before it is tokenized, and the count against the fan-out limit."""
    prompts = [truncated(ids, req.truncate_prompt_tokens, limits) for ids in _prompt_ids(req, tokenizer, limits)]
    if req.truncate_prompt_tokens is not None and not all(prompts):
        raise bad_request("The prompt is empty.", param="prompt")
    return prompts


def _prompt_ids(req: CompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> list[list[int]]:
    encode = tokenizer.encode_plain if req.add_special_tokens is False else tokenizer.encode
    p = req.prompt
    if isinstance(p, str):
        check_prompt_text(p, limits)
        return [encode(p)]
    if p and all(_is_token_id(t) for t in p):
        return [list(p)]
    if p and all(isinstance(x, str) for x in p):
        check_fan_out(len(p), req.n or 1, limits)
        for x in p:
            check_prompt_text(x, limits)
        return [encode(x) for x in p]
    if p and all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p):
        check_fan_out(len(p), req.n or 1, limits)
        return [list(x) for x in p]
    raise bad_request("`prompt` must be a string, a list of token ids, or a non-empty list of either.",
                      param="prompt")


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chat_prompt(req: ChatCompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                image_urls: Optional[list] = None) -> list[int]:
    """`image_urls`: a multimodal model's list, which gets each image_url part's (url, param)."""
    if not req.messages:
        raise bad_request("`messages` must not be empty.", param="messages")
    if not tokenizer.has_chat_template:
        raise bad_request("The served model's tokenizer has no chat template; use /v1/completions.")
    options = template_options(req, limits.trust_request_chat_template)
    messages, tools = chat_messages(req, tokenizer.tool_format, tokenizer.template_has_tools, image_urls)
    check_prompt_text("".join(content_text(m["content"]) for m in messages), limits, param="messages")
    try:
        ids = tokenizer.encode_chat(messages, tools, add_special_tokens=bool(req.add_special_tokens), **options)
    except Exception as e:  # the template itself may reject an order of roles
        raise bad_request(f"The chat template rejected the messages: {e}", param="messages") from None
    if req.truncate_prompt_tokens is not None and image_urls:
        raise bad_request("`truncate_prompt_tokens` is not supported with images or audio (it could cut one).",
                          param="truncate_prompt_tokens")
    return truncated(ids, req.truncate_prompt_tokens, limits)


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text leads the answer when it is the assistant's."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        return "".join(part.text or "" for part in content if part.type == "text")
    return content or ""


def constraint_of(req: _GenerationRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> Optional[Constraint]:
    """The request's structured output: its response_format / guided_* field, or its tools."""
    sources = openai_sources(req)
    if isinstance(req, ChatCompletionRequest):
        tools = tools_constraint(req, tokenizer.tool_format)
        if tools is not None:
            if sources:
                raise bad_request("Give `tools` or a structured output, not both.", param=sources[0][0])
            sources = [("tools", tools)]
    return one_constraint(sources, limits)


def completion_choices(req: CompletionRequest, prompts: list[list[int]], limits: RequestLimits,
                       tokenizer: PromptTokenizer) -> list[Choice]:
    best_of = samples_of(req)
    want_logprobs = req.logprobs is not None
    echo = req.logprobs if req.echo and want_logprobs else None  # the echoed prompt's tokens carry logprobs
    # best_of ranks the samples by their logprobs: asked for internally, returned only where asked
    return _choices(req, prompts, limits, tokenizer, req.max_tokens, "max_tokens", want_logprobs or best_of > (req.n or 1),
                    req.logprobs or 0, prompt_logprobs_of(req, limits, echo), samples=best_of)


def samples_of(req: _GenerationRequest) -> int:
    """Engine requests per prompt: `best_of` (at least `n`; more is not streamed, as OpenAI), else `n`."""
    n = 1 if req.n is None else req.n
    best_of = n if req.best_of is None else req.best_of
    if best_of < n:
        raise bad_request(f"`best_of` ({best_of}) must be at least `n` ({n}).", param="best_of")
    if req.stream and best_of > n:  # the best are known only once every sample has finished (as OpenAI)
        raise bad_request("`best_of` greater than `n` cannot be streamed.", param="best_of")
    return best_of


def chat_choices(req: ChatCompletionRequest, prompt_ids: list[int], limits: RequestLimits,
                 tokenizer: PromptTokenizer) -> list[Choice]:
    top = req.top_logprobs
    if top is not None and top > 0 and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    best_of = samples_of(req)
    return _choices(req, [prompt_ids], limits, tokenizer, max_tokens, param, bool(req.logprobs) or best_of > (req.n or 1),
                    top or 0, prompt_logprobs_of(req, limits), samples=best_of)


def prompt_logprobs_of(req: _GenerationRequest, limits: RequestLimits, echo: Optional[int] = None) -> int:
    """SamplingParams.prompt_logprobs: the top k that vLLM's `prompt_logprobs` or an echo with
    `logprobs` asks for (the larger), -1 when neither does."""
    asked = [k for k in (req.prompt_logprobs, echo) if k is not None]
    if not asked:
        return -1
    param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: they are not streamed
        raise bad_request("`prompt_logprobs` is not available with `stream`.", param="prompt_logprobs")
    check_prompt_logprobs(limits, param)
    return max(asked)


def _choices(req: _GenerationRequest, prompts: list[list[int]], limits: RequestLimits, tokenizer: PromptTokenizer,
             max_tokens: Optional[int], max_tokens_param: str, logprobs: bool, top_logprobs: int,
             prompt_logprobs: int = -1, samples: Optional[int] = None) -> list[Choice]:
    """`samples`: engine requests per prompt (best_of), default n."""
    refuse_unserved(req)
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM: not silently ignored
        raise bad_request("`stream_options` needs `stream` set to true.", param="stream_options")
    n = samples or (1 if req.n is None else req.n)
    check_fan_out(len(prompts), n, limits)
    base = _sampling_fields(req, limits, tokenizer)
    choices = []
    for p, prompt_ids in enumerate(prompts):
        new_tokens = max_new_tokens_for(prompt_ids, max_tokens, max_tokens_param, limits)
        if base["min_tokens"] > new_tokens:
            raise bad_request(f"`min_tokens` ({base['min_tokens']}) exceeds the {new_tokens} tokens this completion "
                              "may have.", param="min_tokens")
        for i in range(n):
            seed = None if req.seed is None else req.seed + i  # distinct samples, reproducible
            sampling = SamplingParams(max_new_tokens=new_tokens, seed=seed, logprobs=logprobs,
                                      top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs, **base)
            choices.append(Choice(index=p * n + i, prompt=p, prompt_ids=prompt_ids, sampling=sampling))
    for token_id in base["stop_token_ids"]:
        check_token_id(token_id, limits, "stop_token_ids")
    return choices


def _sampling_fields(req: _GenerationRequest, limits: RequestLimits, tokenizer: PromptTokenizer) -> dict:
    defaults = limits.sampling_defaults  # the checkpoint's generation_config.json, model.sampling_defaults

    def value(name: str, off: float) -> float:
        given = getattr(req, name)
        return given if given is not None else defaults.get(name, off)

    temperature = 0.0 if req.do_sample is False else greedy_temperature(value("temperature", 1.0))
    top_k = int(value("top_k", -1))
    top_k = -1 if top_k == 0 else top_k  # 0 and -1 both mean: no top-k
    fields = dict(temperature=temperature, top_p=value("top_p", 1.0),
                  top_k=-1 if top_k >= limits.vocab_size else top_k,  # the whole vocabulary: no top-k
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  repetition_penalty=value("repetition_penalty", 1.0))
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    fields["stop"] = check_stop_strings(stop, limits, "stop")
    if len(req.stop_token_ids or []) > limits.max_stop_strings:
        raise bad_request(f"`stop_token_ids` has {len(req.stop_token_ids)} ids; at most {limits.max_stop_strings} "
                          "(server.max_stop_strings).", param="stop_token_ids")
    fields["stop_token_ids"] = list(req.stop_token_ids or [])
    fields["ignore_eos"] = bool(req.ignore_eos)
    # as vLLM: the stop string or the eos / stop token that ended the text is in it only when asked
    fields["include_stop_str_in_output"] = fields["stop_token_text"] = bool(req.include_stop_str_in_output)
    fields["skip_special_tokens"] = True if req.skip_special_tokens is None else req.skip_special_tokens
    fields["spaces_between_special_tokens"] = bool(req.spaces_between_special_tokens)
    fields["min_p"] = value("min_p", 0.0)
    fields["min_tokens"] = req.min_tokens or 0
    fields["bias_ids"], fields["bias_values"] = logit_bias_of(req.logit_bias, limits)
    fields["banned_ids"], fields["banned_sequences"] = bad_words_of(req.bad_words, tokenizer, limits)
    for token_id in req.allowed_token_ids or []:
        check_token_id(token_id, limits, "allowed_token_ids")
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise bad_request("`allowed_token_ids` must not be empty.", param="allowed_token_ids")
    fields["allowed_ids"] = list(dict.fromkeys(req.allowed_token_ids or []))
    fields["constraint"] = constraint_of(req, tokenizer, limits)
    return fields


def logit_bias_of(bias: Optional[dict[str, float]], limits: RequestLimits) -> tuple[list[int], list[float]]:
    """OpenAI's logit_bias (token id as a JSON key → bias in [-100, 100]) as two lists."""
    if not bias:
        return [], []
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"`logit_bias` has {len(bias)} entries; at most {MAX_LOGIT_BIAS}.", param="logit_bias")
    ids = []
    for key in bias:
        if not (key.isascii() and key.isdigit() and int(key) < limits.vocab_size):  # '²'.isdigit(), int('²') fails
            raise bad_request(f"`logit_bias` key {key!r} is not a token id in [0, {limits.vocab_size}).",
                              param="logit_bias")
        ids.append(int(key))
    return ids, list(bias.values())


def bad_words_of(words: Optional[list[str]], tokenizer: PromptTokenizer,
                 limits: RequestLimits) -> tuple[list[int], list[list[int]]]:
    """vLLM's bad_words: each word's tokens, alone and after a space (as it appears mid-text). A word
    of one token is never generated; of several, its last token never follows the others."""
    if not words:
        return [], []
    words = check_stop_strings(words, limits, "bad_words")  # the same bounds as stop strings
    single, sequences = set(), []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode_plain(text)
            if len(ids) == 1:
                single.add(ids[0])
            elif ids and ids not in sequences:
                sequences.append(ids)
    return sorted(single), sequences
