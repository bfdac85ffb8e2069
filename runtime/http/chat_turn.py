"""One assistant turn of a chat request, served for another API dialect (OpenAI's Responses API,
Anthropic's Messages API). The dialect translates its request into a ChatCompletionRequest; the chat
machinery renders the template, checks every value, constrains tool calls and structured output and
builds the engine work (OpenAIServing.chat_work); the generated text comes back as parts (a thinking
model's reasoning where server.reasoning_parser splits it off, text, tool calls) that the dialect's
`TurnShape` turns into its own objects and stream events. A whole answer is
the stream's parts gathered, so the two never differ."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Protocol, Union

from quart import Response

from llaunch.runtime.config import ReasoningParser
from llaunch.runtime.http.engine_client import RequestGroup, admitted
from llaunch.runtime.web.errors import ApiError, stream_error
from llaunch.runtime.http.openai_protocol import ChatCompletionRequest, Choice
from llaunch.runtime.http.openai_serving import ChoiceState, OpenAIServing
from llaunch.runtime.http.reasoning import ReasoningStream
from llaunch.runtime.web.sse import TrackedStream, sse_event, sse_response
from llaunch.runtime.http.tool_calls import ParsedCall, ToolCallStream, tool_format_of
from llaunch.runtime.ipc.messages import SamplingParams, TextDelta


@dataclass
class Thought:
    """Reasoning: text of a thinking model's <think> block (server.reasoning_parser)."""

    text: str


Part = Union[str, ParsedCall, Thought]  # answer text, a whole tool call, or reasoning


class TurnShape(Protocol):
    """A dialect's objects and events for a turn; each method returns the events to stream."""

    def opened(self, state: ChoiceState) -> list[dict]: ...  # the first delta came (cached tokens known)

    def part(self, part: Part) -> list[dict]: ...

    def finished(self, state: ChoiceState) -> list[dict]: ...

    def failed(self, error: ApiError) -> list[dict]: ...  # the engine failed the request mid-stream


class ErrorNames:
    """The dialect's names for the chat fields an error names (its `param` and its message): `fields`
    [(pattern, replacement)], and `origins`: chat message j came from the dialect's `origins[j]`."""

    def __init__(self, fields: list[tuple[str, str]], origins: Optional[list[str]] = None):
        self.fields = [(re.compile(p), r) for p, r in fields]
        self.origins = origins or []

    def text(self, text: str) -> str:
        text = re.sub(r"\bmessages\[(\d+)\]", lambda m: self._origin(int(m.group(1))), text)
        for pattern, replacement in self.fields:
            text = pattern.sub(replacement, text)
        return text

    def _origin(self, j: int) -> str:
        return self.origins[j] if j < len(self.origins) else f"messages[{j}]"

    def error(self, e: ApiError) -> ApiError:
        return ApiError(e.status, self.text(e.message), type=e.type, param=e.param and self.text(e.param),
                        code=e.code, headers=e.headers)


@dataclass
class Turn:
    """The engine work of one translated request."""

    prompt_ids: list[int]
    choice: Choice
    images: list
    tool_format: Optional[str]  # the call format its text is parsed with (tools offered), else None
    reasoning: str  # server.reasoning_parser
    names: ErrorNames  # what its errors call the chat request's fields


def prepare_turn(chat: OpenAIServing, req: ChatCompletionRequest, names: ErrorNames,
                 adjust: Optional[Callable[[SamplingParams], SamplingParams]] = None) -> Turn:
    """The translated request through the chat path (in a worker thread: it tokenizes); `adjust`: the
    dialect's change to the sampling (Anthropic's stop sequences are kept, to name the one that hit)."""
    try:
        prompt_ids, [choice], images = chat.chat_work(req)
    except ApiError as e:
        raise names.error(e) from None
    if adjust is not None:
        choice = Choice(choice.index, choice.prompt, choice.prompt_ids, adjust(choice.sampling))
    return Turn(prompt_ids, choice, images, tool_format_of(req, chat.tokenizer), chat.limits.reasoning_parser, names)


async def submit_turn(chat: OpenAIServing, turn: Turn) -> RequestGroup:
    try:  # a refusal here (a structured output that does not compile) names the chat request's fields too
        return await chat.engine.submit([(turn.choice.prompt_ids, turn.choice.sampling)], lifecycle=chat.lifecycle,
                                        images=list(turn.images))
    except ApiError as e:
        raise turn.names.error(e) from None


class TurnParts:
    """Generated text → parts: a thinking model's reasoning split off first (as chat does), then with
    tools content and calls as the chat stream finds them (text that may open a call held back);
    without, the text as it comes."""

    def __init__(self, tool_format: Optional[str], reasoning: str = ReasoningParser.none.value):
        self.calls = ToolCallStream(tool_format) if tool_format else None
        self.thoughts = ReasoningStream(reasoning) if reasoning != ReasoningParser.none.value else None

    def feed(self, text: str) -> list[Part]:
        thought = ""
        if self.thoughts is not None:
            thought, text = self.thoughts.feed(text)
        return ([Thought(thought)] if thought else []) + self._answer(text)

    def _answer(self, text: str) -> list[Part]:
        if self.calls is None:
            return [text] if text else []
        return self.calls.parts(text)

    def finish(self, cut: bool) -> list[Part]:
        """`cut`: the length limit ended the text, so a call still open is dropped (tool_calls.py)."""
        parts: list[Part] = []
        if self.thoughts is not None:
            thought, text = self.thoughts.finish()
            parts = ([Thought(thought)] if thought else []) + self._answer(text)
        return parts + (self.calls.finish_parts(cut) if self.calls is not None else [])


async def turn_events(deltas: AsyncIterator[TextDelta], turn: Turn, shape: TurnShape) -> AsyncIterator[dict]:
    """The dialect's events for the engine's deltas, from `opened` to `finished`."""
    state, parts = ChoiceState(), TurnParts(turn.tool_format, turn.reasoning)
    opened = False
    async for delta in deltas:
        text = state.add(delta)  # an engine failure raises here
        if not opened:
            opened = True
            for event in shape.opened(state):
                yield event
        for part in parts.feed(text):
            for event in shape.part(part):
                yield event
    for part in parts.finish(cut=state.finish_reason == "length"):
        for event in shape.part(part):
            yield event
    for event in shape.finished(state):
        yield event


async def group_deltas(group: RequestGroup) -> AsyncIterator[TextDelta]:
    async for _, delta in group:
        yield delta


async def whole_turn(group: RequestGroup, deltas: AsyncIterator[TextDelta], turn: Turn, shape: TurnShape) -> None:
    """Run the turn to its end; the shape holds the answer."""
    try:
        async for _ in turn_events(deltas, turn, shape):
            pass
    finally:
        await group.close()  # aborts what an engine failure or a gone client left running


def named_event(event: dict) -> bytes:
    """An SSE frame named by the event's type (`event: <type>`), as both dialects stream them."""
    return sse_event(event, prefix=b"event: " + event["type"].encode() + b"\ndata: ")


async def streamed_turn(group: RequestGroup, deltas: AsyncIterator[TextDelta], turn: Turn,
                        shape: TurnShape) -> Response:
    await admitted(group)  # a refused request answers with its status, not a 200 stream

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for event in turn_events(deltas, turn, shape):
                yield named_event(event)
        except Exception as e:  # an engine failure, or a bug: the client still gets the dialect's error event
            for event in shape.failed(stream_error(e)):
                yield named_event(event)

    return sse_response(TrackedStream(frames(), group))
