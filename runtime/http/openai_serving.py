"""POST /v1/completions and /v1/chat/completions: validate, submit one engine request per choice,
then either collect every choice into one response or stream a chunk per TextDelta.

Parsing, the chat template and tokenization run in a worker thread (the tokenizer releases the
GIL), so a large prompt never holds up the event loop: /health and every other stream keep going."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional, Sequence

from quart import Response

from llaunch.runtime.config import ReasoningParser
from llaunch.runtime.http import openai_responses as shapes
from llaunch.runtime.http.audio import MediaParts
from llaunch.runtime.http.images import chat_images
from llaunch.runtime.http.engine_client import EngineClient, RequestGroup, admitted
from llaunch.runtime.web.errors import ApiError, engine_failed, json_response, stream_error
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.openai_protocol import (ChatCompletionRequest, Choice, CompletionRequest, RequestLimits,
                                                  adopt_functions, chat_choices, chat_echo, chat_prompt, check_model,
                                                  completion_choices, completion_prompts)
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_logprob_sharing import SharedPromptLogprobs, ask_once, relayed
from llaunch.runtime.http.predicted_output import prediction_ids, prediction_usage
from llaunch.runtime.http.prompt_logprobs import echo_logprobs, echo_text_length, vllm_prompt_logprobs
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.web.sse import DONE, TrackedStream, sse_event, sse_response
from llaunch.runtime.http.token_healing import TokenHealer, healed, healing_of
from llaunch.runtime.http.reasoning import ReasoningStream, split_reasoning
from llaunch.runtime.http.tool_calls import ToolCallStream, parse_tool_calls, tool_format_of
from llaunch.runtime.ipc.messages import PromptLogprobs, TextDelta

FINISH_REASONS = ("stop", "length")  # anything else (abort, error) means the engine failed the request


class ChoiceState:
    """What one choice has produced so far."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix  # echoed prompt, sent before the first text
        self.cum_logprob = 0.0  # of the sampled tokens: what best_of ranks by
        self.text: list[str] = [prefix]
        self.logprobs: list = []
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0  # of its prompt, served by the prefix cache
        self.finish_reason: Optional[str] = None
        self.prompt_logprobs: Optional[PromptLogprobs] = None  # where asked: with the first token

    def add(self, delta: TextDelta) -> str:
        """Record the delta; returns the text to send for it (the echo goes out with the first)."""
        text, self.prefix = self.prefix + delta.text, ""
        self.text.append(delta.text)
        self.cum_logprob += sum(delta.logprobs)
        self.token_ids.extend(delta.token_ids)
        self.completion_tokens = delta.completion_tokens or self.completion_tokens + len(delta.token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            if delta.finish_reason not in FINISH_REASONS:
                raise engine_failed(delta.finish_reason, delta.error)
            self.finish_reason = delta.finish_reason
        return text


class PromptLogprobsFormat:
    """vLLM's `prompt_logprobs` (`top` alternatives; None: not asked): on each completions choice,
    at the top of a chat response."""

    def __init__(self, tokenizer: PromptTokenizer, prompts: list[list[int]], top: Optional[int]):
        self.tokenizer, self.prompts, self.top = tokenizer, prompts, top

    def of(self, index: int, state: ChoiceState) -> Optional[list]:
        if state.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.prompts[index], state.prompt_logprobs, self.top, self.tokenizer)

    def finish_response(self, body: dict, states: list[ChoiceState]) -> None:
        pass


class CompletionFormat(PromptLogprobsFormat):
    kind = "completion"

    def __init__(self, tokenizer: PromptTokenizer, want_logprobs: bool, n: int, prompts: Optional[list[list[int]]] = None,
                 echo_top: Optional[int] = None, top: Optional[int] = None, token_ids_as_tokens: bool = False):
        """`prompts`: each choice's prompt ids; `echo_top`: an echo with logprobs (its top k), whose
        prompt tokens lead the logprobs; `top`: vLLM's prompt_logprobs; `token_ids_as_tokens`: vLLM's
        return_tokens_as_token_ids."""
        super().__init__(tokenizer, prompts or [], top)
        self.echo_top = echo_top
        start = [echo_text_length(p, tokenizer) if echo_top is not None else 0 for p in self.prompts] or [0] * n
        self.tracks = ([shapes.CompletionLogprobs(tokenizer, start[i], token_ids_as_tokens) for i in range(n)]
                       if want_logprobs else None)

    def opening(self, n: int) -> list[dict]:
        return []

    def logprobs_of(self, index: int, delta: TextDelta, state: ChoiceState) -> Optional[dict]:
        if self.tracks is None:
            return None
        part = self.tracks[index].of(delta)
        if self.echo_top is not None and delta.prompt_logprobs is not None:
            echoed = echo_logprobs(self.prompts[index], delta.prompt_logprobs, self.echo_top, self.tokenizer)
            part = shapes.merge_completion_logprobs([echoed, part])
        state.logprobs.append(part)
        return part

    def chunk_choices(self, index: int, text: str, logprobs: Optional[dict], finish_reason: Optional[str]) -> list:
        return [shapes.completion_choice(index, text, logprobs, finish_reason)]

    def final_choice(self, index: int, state: ChoiceState) -> dict:
        logprobs = shapes.merge_completion_logprobs(state.logprobs) if self.tracks is not None else None
        choice = shapes.completion_choice(index, "".join(state.text), logprobs, state.finish_reason)
        if self.top is not None:
            choice["prompt_logprobs"] = self.of(index, state)
        return choice


class ChatFormat(PromptLogprobsFormat):
    kind = "chat"

    def __init__(self, tokenizer: PromptTokenizer, want_logprobs: bool, n: int, tool_format: Optional[str] = None,
                 prompt_ids: Optional[list[int]] = None, top: Optional[int] = None, functions: bool = False,
                 token_ids_as_tokens: bool = False, reasoning: str = "none", include_reasoning: bool = True):
        """`tool_format`: the call format when the request offers tools (its text is parsed for calls);
        `top`: vLLM's prompt_logprobs, of `prompt_ids`; `functions`: the request gave OpenAI's older
        `functions`, so its call comes back as `function_call`; `token_ids_as_tokens`: vLLM's
        return_tokens_as_token_ids; `reasoning`: server.reasoning_parser (the <think> block is split off
        before tool calls are parsed, and returned unless `include_reasoning` is false)."""
        super().__init__(tokenizer, [prompt_ids or []] * n, top)
        self.want_logprobs = want_logprobs
        self.tool_format = tool_format
        self.functions = functions
        self.token_ids_as_tokens = token_ids_as_tokens
        self.streams = [ToolCallStream(tool_format) for _ in range(n)] if tool_format else None
        self.reasoning = ReasoningParser(reasoning)
        self.include_reasoning = include_reasoning
        self.thoughts = [ReasoningStream(self.reasoning) for _ in range(n)] if self.reasoning != ReasoningParser.none \
            else None

    def opening(self, n: int) -> list[dict]:
        # OpenAI's first chunk of each choice names the role; content follows in later chunks.
        return [shapes.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None) for i in range(n)]

    def logprobs_of(self, index: int, delta: TextDelta, state: ChoiceState) -> Optional[list]:
        if not self.want_logprobs:
            return None
        part = shapes.chat_logprobs(delta, self.tokenizer, self.token_ids_as_tokens)
        state.logprobs.extend(part)
        return part

    def chunk_choices(self, index: int, text: str, logprobs: Optional[list], finish_reason: Optional[str]) -> list:
        thought = ""
        if self.thoughts is not None:
            thought, text = self.thoughts[index].feed(text)
            if finish_reason is not None:
                more_thought, more_text = self.thoughts[index].finish()
                thought, text = thought + more_thought, text + more_text
            thought = thought if self.include_reasoning else ""
        if self.streams is None:
            delta = {**({"reasoning_content": thought} if thought else {}), **({"content": text} if text else {})}
            return [shapes.chat_chunk_choice(index, delta, logprobs, finish_reason)]
        stream = self.streams[index]
        deltas = ([{"reasoning_content": thought}] if thought else []) + stream.feed(text)
        if finish_reason is not None:
            deltas += stream.finish(cut=finish_reason == "length")
            finish_reason = _with_calls(finish_reason, stream.calls, self.functions)
        if self.functions:
            deltas = [d if "reasoning_content" in d else _function_call_delta(d) for d in deltas]
        if not deltas:  # the text is held back as a possible call
            return [shapes.chat_chunk_choice(index, {}, logprobs, finish_reason)]
        last = len(deltas) - 1
        return [shapes.chat_chunk_choice(index, d, logprobs if j == 0 else None, finish_reason if j == last else None)
                for j, d in enumerate(deltas)]

    def final_choice(self, index: int, state: ChoiceState) -> dict:
        text, logprobs = "".join(state.text), state.logprobs if self.want_logprobs else None
        thought = None
        if self.thoughts is not None:
            thought, text = split_reasoning(text, self.reasoning)
        choice = self._answer(index, text, logprobs, state.finish_reason)
        if thought is not None and self.include_reasoning:
            choice["message"]["reasoning_content"] = thought
        return choice

    def _answer(self, index: int, text: str, logprobs: Optional[list], finish_reason: Optional[str]) -> dict:
        if self.tool_format is None:
            return shapes.chat_choice(index, text, logprobs, finish_reason)
        content, calls = parse_tool_calls(text, self.tool_format, cut=finish_reason == "length")
        choice = shapes.chat_choice(index, content, logprobs, _with_calls(finish_reason, len(calls), self.functions))
        if calls and self.functions:
            choice["message"]["function_call"] = calls[0].openai()["function"]
        elif calls:
            choice["message"]["tool_calls"] = [c.openai() for c in calls]
        return choice

    def finish_response(self, body: dict, states: list[ChoiceState]) -> None:
        if self.top is not None:  # vLLM's chat response holds them once, beside `choices`
            body["prompt_logprobs"] = self.of(0, states[0]) if states else None


def _usage(choices: list[Choice], states: list[ChoiceState], prompt_tokens: int) -> dict:
    """Usage; a prompt's cached tokens are those of its first choice (the others share its prefill)."""
    first = {}
    for choice, state in zip(choices, states):
        first.setdefault(choice.prompt, state)
    return shapes.usage(prompt_tokens, sum(s.completion_tokens for s in states),
                        sum(s.cached_tokens for s in first.values()))


def best_of(req, choices: list[Choice], states: list[ChoiceState]) -> list[int]:
    """The choices to return: with `best_of` > n, each prompt's n samples of the highest cumulative
    logprob, best first (vLLM's ranking; usage still counts every sample, as OpenAI's); else all."""
    n = req.n or 1
    if getattr(req, "best_of", None) in (None, n):
        return list(range(len(states)))
    by_prompt: dict[int, list[int]] = {}
    for i, choice in enumerate(choices):
        by_prompt.setdefault(choice.prompt, []).append(i)
    return [i for p in sorted(by_prompt) for i in sorted(by_prompt[p], key=lambda i: -states[i].cum_logprob)[:n]]


def _with_calls(finish_reason: Optional[str], calls: int, functions: bool = False) -> Optional[str]:
    """OpenAI's finish reason of an answer that called tools (or, given `functions`, a function)."""
    if calls and finish_reason == "stop":
        return "function_call" if functions else "tool_calls"
    return finish_reason


def _function_call_delta(delta: dict) -> dict:
    """A tool-call stream delta as OpenAI streams a `functions` call: delta.function_call."""
    if "tool_calls" not in delta:
        return delta
    return {"function_call": dict(delta["tool_calls"][0]["function"])}


class OpenAIServing:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle,
                 images=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.lifecycle = lifecycle
        self.healer = TokenHealer(tokenizer)
        self.images = images  # ImageInputs of a multimodal model (runtime/http/images.py), AudioInputs, else None

    async def completions(self, body: bytes) -> Response:
        req, prompts, choices, echo = await asyncio.to_thread(self._parse_completion, body)
        states = [ChoiceState(echo[c.prompt] if echo else "") for c in choices]
        echo_top = req.logprobs if req.echo and req.logprobs is not None else None
        fmt = CompletionFormat(self.tokenizer, req.logprobs is not None, len(choices), [c.prompt_ids for c in choices],
                               echo_top, req.prompt_logprobs, bool(req.return_tokens_as_token_ids))
        return await self._serve(req, choices, prompts, states, fmt)

    def _parse_completion(self, body: bytes):
        req = decode_body(body, CompletionRequest)
        check_model(req.model, self.limits)
        prompts = completion_prompts(req, self.tokenizer, self.limits)
        echo = [self._echo_text(req, p, ids) for p, ids in enumerate(prompts)] if req.echo else None
        choices = completion_choices(req, prompts, self.limits, self.tokenizer)
        healings = [healing_of(self.healer, ids, req.token_healing, self.limits,
                               [c.sampling for c in choices if c.prompt == p], "token_healing")
                    for p, ids in enumerate(prompts)]
        if any(healings):  # the backed-off prompt is what runs
            prompts = [h.prompt_ids if h else ids for h, ids in zip(healings, prompts)]
            choices = [dataclasses.replace(c, prompt_ids=prompts[c.prompt], sampling=healed(c.sampling, healings[c.prompt]))
                       for c in choices]
        return req, prompts, choices, echo

    async def chat(self, body: bytes) -> Response:
        req, prompt_ids, choices, images, predicted = await asyncio.to_thread(self._parse_chat, body)
        states = [ChoiceState(chat_echo(req)) for _ in choices]
        fmt = ChatFormat(self.tokenizer, bool(req.logprobs), len(choices), tool_format_of(req, self.tokenizer),
                         prompt_ids, req.prompt_logprobs, functions=bool(req.functions),
                         token_ids_as_tokens=bool(req.return_tokens_as_token_ids),
                         reasoning=self.limits.reasoning_parser, include_reasoning=req.include_reasoning is not False)
        return await self._serve(req, choices, [prompt_ids], states, fmt, images, predicted)

    def _parse_chat(self, body: bytes):
        req = decode_body(body, ChatCompletionRequest)
        return (req, *self.chat_work(req), prediction_ids(req.prediction, self.tokenizer, self.limits.max_model_len))

    def chat_work(self, req: ChatCompletionRequest) -> tuple[list[int], list[Choice], list]:
        """(prompt ids, engine choices, images) of a chat request; the Responses and Anthropic dialects
        translate theirs into one (runtime/http/chat_turn.py)."""
        prompt_ids, images = self.chat_prompt_ids(req)
        if not images:
            return prompt_ids, chat_choices(req, prompt_ids, self.limits, self.tokenizer), images
        # an image's tokens (vocab + hash) are checked as the placeholder they stand for, then put back
        checked = [t if t < self.limits.vocab_size else self.images.image_token_id for t in prompt_ids]
        choices = [dataclasses.replace(c, prompt_ids=prompt_ids)
                   for c in chat_choices(req, checked, self.limits, self.tokenizer)]
        return prompt_ids, choices, images

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> tuple[list[int], list]:
        """(prompt ids, images): the chat template's prompt, each image or clip as its tokens."""
        check_model(req.model, self.limits)
        adopt_functions(req)
        urls = None if self.images is None else MediaParts(self.images)
        prompt_ids = chat_prompt(req, self.tokenizer, self.limits, urls)
        return (self.images.chat(req, prompt_ids, urls) if urls is not None and urls.audio
                else chat_images(self.images, req, prompt_ids, urls))

    def _echo_text(self, req: CompletionRequest, p: int, ids: list[int]) -> str:
        if isinstance(req.prompt, str):
            return req.prompt
        if isinstance(req.prompt[0], str):
            return req.prompt[p]
        return self.tokenizer.decode(ids)

    async def _serve(self, req, choices: list[Choice], prompts: list[list[int]], states: list[ChoiceState],
                     fmt, images=(), predicted: Sequence[int] = ()) -> Response:
        header = shapes.ResponseHeader(fmt.kind, self.limits.served_name, req.request_id)
        prompt_tokens = sum(len(p) for p in prompts)
        asked = ask_once(choices)
        relay = SharedPromptLogprobs(choices, asked)
        group = await self.engine.submit([(c.prompt_ids, c.sampling) for c in asked], lifecycle=self.lifecycle,
                                         images=list(images), priority=req.priority or 0, prediction_ids=predicted)
        if req.stream:
            await admitted(group)  # a refused request answers with its status, not a 200 stream
            events = self._stream(group, relay, header, choices, states, fmt, prompt_tokens, req.include_usage,
                                  bool(req.return_token_ids), req.continuous_usage, predicted)
            return sse_response(TrackedStream(events, group))
        try:
            async for index, delta in relayed(group, relay):
                states[index].add(delta)
                fmt.logprobs_of(index, delta, states[index])
        finally:
            await group.close()  # aborts what an engine failure or a gone client left running
        picked = best_of(req, choices, states)
        final = [fmt.final_choice(i, states[i]) for i in picked]
        for k, (c, i) in enumerate(zip(final, picked)):
            c["index"] = k
            if req.return_token_ids:
                c["token_ids"], c["prompt_token_ids"] = states[i].token_ids, choices[i].prompt_ids
        body = header.whole(final, _usage(choices, states, prompt_tokens))
        if predicted:
            body["usage"]["completion_tokens_details"] = await prediction_usage(predicted, [s.token_ids for s in states])
        fmt.finish_response(body, states)
        return json_response(body)

    async def _stream(self, group: RequestGroup, relay: SharedPromptLogprobs, header: shapes.ResponseHeader,
                      choices: list[Choice],
                      states: list[ChoiceState], fmt, prompt_tokens: int, include_usage: bool,
                      token_ids: bool = False, continuous_usage: bool = False,
                      predicted: Sequence[int] = ()) -> AsyncIterator[bytes]:
        """`continuous_usage` (vLLM's continuous_usage_stats): every chunk carries the usage so far; the last
        usage counts a prediction's accepted and rejected tokens."""
        def usage_now() -> Optional[dict]:
            return _usage(choices, states, prompt_tokens) if continuous_usage else None

        for choice in fmt.opening(len(states)):  # one choice per chunk, as OpenAI streams
            yield sse_event(header.chunk([choice], usage_now(), include_usage))
        try:
            async for index, delta in relayed(group, relay):
                text = states[index].add(delta)
                logprobs = fmt.logprobs_of(index, delta, states[index])
                chunk = fmt.chunk_choices(index, text, logprobs, delta.finish_reason)
                if token_ids and chunk:
                    chunk[0]["token_ids"] = delta.token_ids
                for choice in chunk:
                    yield sse_event(header.chunk([choice], usage_now(), include_usage))
        except Exception as e:  # an engine failure, or a bug: the client still gets the error and [DONE]
            yield sse_event(stream_error(e).body())
            yield DONE
            return
        if include_usage:
            final = _usage(choices, states, prompt_tokens)
            if predicted:
                final["completion_tokens_details"] = await prediction_usage(predicted, [s.token_ids for s in states])
            yield sse_event(header.chunk([], final, True))
        yield DONE
