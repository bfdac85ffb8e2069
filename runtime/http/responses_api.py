"""OpenAI's Responses API: POST /v1/responses, served statelessly through the chat path
(runtime/http/chat_turn.py). `input` (a string, or items: messages with input_text / input_image /
output_text parts, function_call and function_call_output items) and `instructions` become chat
messages; function `tools`, `tool_choice`, `text.format` (structured output), `max_output_tokens`,
`temperature`, `top_p` become the chat request's fields. The answer is output items (a thinking model's
reasoning item where server.reasoning_parser splits it off, a message with output_text, function_call
items), whole or streamed as OpenAI streams them (response.created ... response.completed, each with its
sequence_number).

llaunch keeps no responses: `store` true, `previous_response_id`, `conversation`, `background` and
item references are refused with a 400 that says so; a client sends the whole conversation each time."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.http.chat_turn import (ErrorNames, Part, Thought, Turn, group_deltas, prepare_turn,
                                            streamed_turn, submit_turn, whole_turn)
from llaunch.runtime.web.errors import ApiError, bad_request, json_response
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.http.openai_protocol import (ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall,
                                                  FunctionDefinition, ImageUrl, JsonSchemaFormat, ResponseFormat,
                                                  Tool, ToolCall)
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.openai_serving import ChoiceState, OpenAIServing
from llaunch.runtime.http.request_limits import Temperature, TokenCount, TopLogprobs, TopP

# the chat path's names for what this API calls otherwise (its errors say the client's names)
_NAMES = [(r"response_format\.json_schema\.schema", "text.format.schema"),
          (r"response_format(\.json_schema)?", "text.format"), (r"max_completion_tokens", "max_output_tokens"),
          (r"tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"\bmessages\b(?!\[)", "input")]
_STATELESS = "llaunch keeps no responses or conversations: send the whole conversation in `input`"
_BUILT_IN = "llaunch runs no tools itself; give `function` tools and run them in the client"


class InputPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # input_text | output_text (an earlier answer) | refusal | input_image (vision models); input_file: 400
    text: Optional[str] = None
    image_url: Optional[str] = None
    detail: Optional[str] = None
    file_id: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None  # an earlier answer's, sent back: unused
    logprobs: Optional[list[Any]] = None
    file_data: Optional[str] = None
    file_url: Optional[str] = None
    filename: Optional[str] = None


class InputItem(msgspec.Struct, forbid_unknown_fields=True):
    """One `input` item: a message (`type` message or unset), a function_call (an earlier answer's),
    or a function_call_output (the client's result of one)."""

    type: Optional[str] = None
    role: Optional[str] = None  # user | assistant | system | developer
    content: Union[str, list[InputPart], None] = None
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, list[InputPart], None] = None
    namespace: Optional[str] = None
    caller: Optional[dict[str, Any]] = None
    async_: Optional[bool] = msgspec.field(name="async", default=None)
    summary: Optional[list[Any]] = None  # a reasoning item's (sent back: dropped)
    encrypted_content: Optional[str] = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # the grammar always holds a call to its parameters
    defer_loading: Optional[bool] = None
    allowed_callers: Optional[list[str]] = None
    output_schema: Optional[dict[str, Any]] = None
    namespace: Optional[str] = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    name: Optional[str] = None
    schema: Optional[dict[str, Any]] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # accepted without effect


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: Optional[bool] = None  # OpenAI's padding against length side channels: none added


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Optional[str] = None
    input: Union[str, list[InputItem], None] = None
    instructions: Optional[str] = None
    # each checked on its own: a built-in tool is refused for what it is, whatever its other fields
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None  # none | auto | required | {"type": "function", "name"}
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[TokenCount] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    stream: Optional[bool] = None
    stream_options: Optional[ResponsesStreamOptions] = None
    store: Optional[bool] = None  # false or unset: llaunch stores nothing
    include: Optional[list[str]] = None
    truncation: Optional[str] = None  # disabled (a prompt longer than the context is a 400); auto: refused
    # accepted without effect: hints about billing, caching and safety; a reasoning effort (a thinking
    # model thinks as its template has it)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    # refused where set (_refuse_stateful, _refuse_unserved say why)
    previous_response_id: Optional[str] = None
    conversation: Union[str, dict[str, Any], None] = None
    background: Optional[bool] = None
    prompt: Optional[dict[str, Any]] = None
    top_logprobs: Optional[TopLogprobs] = None
    max_tool_calls: Optional[int] = None


def _refuse_unserved(req: ResponsesRequest) -> None:
    stateful = {"store": req.store is True, "previous_response_id": req.previous_response_id is not None,
                "conversation": req.conversation is not None,
                "background": req.background is True}  # a background response is fetched later: stored
    for name, asked in stateful.items():
        if asked:
            raise bad_request(f"`{name}` is not supported: {_STATELESS}.", param=name)
    if req.prompt is not None:
        raise bad_request("`prompt` (a stored prompt template) is not supported: llaunch stores no prompts; send "
                          "`instructions` and `input`.", param="prompt")
    if req.truncation not in (None, "disabled"):
        raise bad_request("`truncation` auto is not supported: a conversation longer than the context is refused, "
                          "not cut.", param="truncation")
    if req.top_logprobs or any(i != "reasoning.encrypted_content" for i in req.include or []):
        param = "top_logprobs" if req.top_logprobs else "include"
        raise bad_request(f"`{param}`: only `reasoning.encrypted_content` may be included (llaunch encrypts no "
                          "reasoning: a thinking model's comes back as a reasoning item's content); logprobs are not "
                          "returned by this API.", param=param)
    if req.max_tool_calls is not None:
        raise bad_request("`max_tool_calls` is not supported: use `parallel_tool_calls` false for one call at most.",
                          param="max_tool_calls")
    if req.input is None:
        raise bad_request(f"`input` is required ({_STATELESS}).", param="input")


def _parts(content: Union[str, list[InputPart], None], param: str, vision: bool) -> Union[str, list[ContentPart], None]:
    """Responses content parts → chat content parts."""
    if content is None or isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type in ("input_text", "output_text", "text"):
            if part.text is None:
                raise bad_request(f"{where}: a {part.type} part needs `text`.", param=f"{where}.text")
            out.append(ContentPart(type="text", text=part.text))
        elif part.type == "refusal":
            out.append(ContentPart(type="text", text=part.refusal or ""))
        elif part.type == "input_image":
            if not vision:
                raise bad_request(f"{where}: the served model reads text only (images need a vision model: "
                                  "Qwen2-VL, Qwen2.5-VL).", param=where)
            if part.image_url is None:
                raise bad_request(f"{where}: an input_image needs `image_url` (llaunch keeps no files for "
                                  "`file_id`).", param=f"{where}.image_url")
            out.append(ContentPart(type="image_url", image_url=ImageUrl(url=part.image_url, detail=part.detail)))
        else:
            raise bad_request(f"{where}: content parts of type {part.type!r} are not supported (input_text, "
                              "output_text, refusal, input_image).", param=f"{where}.type")
    return out


def _messages(req: ResponsesRequest, vision: bool) -> tuple[list[ChatMessage], list[str]]:
    """(chat messages, where each came from): function_call items join the assistant turn before them."""
    messages, origins = [], []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
        origins.append("instructions")
    if isinstance(req.input, str):
        return messages + [ChatMessage(role="user", content=req.input)], origins + ["input"]
    for i, item in enumerate(req.input):
        where, kind = f"input[{i}]", item.type or "message"
        if kind == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role {item.role!r} is not one of user, assistant, system, developer.",
                                  param=f"{where}.role")
            messages.append(ChatMessage(role=item.role, content=_parts(item.content, f"{where}.content", vision)))
        elif kind == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise bad_request(f"{where}: a function_call item needs `call_id`, `name` and `arguments`.",
                                  param=where)
            _check_json(item.arguments, f"{where}.arguments")
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":  # the same answer: its text, then its calls
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
                continue
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise bad_request(f"{where}: a function_call_output item needs `call_id` and `output`.", param=where)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_parts(item.output, f"{where}.output", vision)))
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references are not supported: {_STATELESS}.", param=f"{where}.type")
        elif kind == "reasoning":  # an earlier answer's thoughts: dropped, as chat templates drop them (Qwen3's)
            continue
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                              f"function_call_output; {_BUILT_IN}).", param=f"{where}.type")
        origins.append(where)
    return messages, origins


def _check_json(text: str, param: str) -> None:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        raise bad_request(f"`{param}` is not JSON.", param=param) from None


def _tools(req: ResponsesRequest) -> Optional[list[Tool]]:
    if req.tools is None:
        return None
    tools = []
    for i, raw in enumerate(req.tools):
        kind = raw.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}]: the built-in tool {kind!r} is not supported: {_BUILT_IN}.",
                              param=f"tools[{i}].type")
        t = decode_body(msgspec.json.encode(raw), FunctionTool, where=f"tools[{i}]")
        tools.append(Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                                        parameters=t.parameters, strict=t.strict)))
    return tools


def _tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice!r} is not supported: none, auto, required or "
                      f'{{"type": "function", "name": ...}} ({_BUILT_IN}).', param="tool_choice")


def _response_format(text: Optional[TextConfig]) -> Optional[ResponseFormat]:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise bad_request("text.format of type json_schema needs `schema`.", param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))
    raise bad_request(f"text.format.type {fmt.type!r} is not one of text, json_object, json_schema.",
                      param="text.format.type")


def chat_request(req: ResponsesRequest, vision: bool) -> tuple[ChatCompletionRequest, ErrorNames]:
    """The chat request that serves `req`, and the names its errors translate back to."""
    _refuse_unserved(req)
    messages, origins = _messages(req, vision)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, tools=_tools(req), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        stream=req.stream)
    return chat, ErrorNames(_NAMES, origins)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """The Response object and its stream events for one turn (chat_turn.TurnShape)."""

    def __init__(self, req: ResponsesRequest, turn: Turn, model: str):
        self.prompt_tokens = len(turn.prompt_ids)
        sampling = turn.choice.sampling
        self.output: list[dict] = []
        self.response: dict[str, Any] = {
            "id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "text": {"format": {"type": "text"} if req.text is None or req.text.format is None
                     else msgspec.to_builtins(req.text.format)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}}
        self.sequence = 0
        self.open: Optional[dict] = None  # the output message or reasoning item being written

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict:
        return dict(self.response, output=[dict(item) for item in self.output])

    def opened(self, state: ChoiceState) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def part(self, part: Part) -> list[dict]:
        if isinstance(part, Thought):
            return self._write("reasoning", part.text)
        if isinstance(part, str):
            return self._write("message", part)
        events = self._close("completed")
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": part.id, "name": part.name}
        index = len(self.output)
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=part.arguments))
        item.update(arguments=part.arguments, status="completed")
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=part.name, arguments=part.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _write(self, kind: str, text: str) -> list[dict]:
        """Text into the open item of `kind` (message: output_text; reasoning: reasoning_text), opened here."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                self.open = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                self.open = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                             "content": []}
                part = {"type": "reasoning_text", "text": ""}
            self.output.append(self.open)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=dict(self.open)))
            self.open["content"] = [part]
            events.append(self._event("response.content_part.added", **self._where(), part=dict(part)))
        self.open["content"][0]["text"] += text
        if kind == "message":
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=text))
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.output.index(self.open), "content_index": 0}

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        where, part = self._where(), self.open["content"][0]
        self.open["status"] = status
        done = (self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
                if self.open["type"] == "message" else
                self._event("response.reasoning_text.done", **where, text=part["text"]))
        events = [done, self._event("response.content_part.done", **where, part=dict(part)),
                  self._event("response.output_item.done", output_index=where["output_index"], item=dict(self.open))]
        self.open = None
        return events

    def finished(self, state: ChoiceState) -> list[dict]:
        cut = state.finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        self.response.update(
            status="incomplete" if cut else "completed", output=self.output, completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": self.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": state.cached_tokens, "cache_write_tokens": 0},
                   "output_tokens": state.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": self.prompt_tokens + state.completion_tokens})
        events.append(self._event("response.incomplete" if cut else "response.completed", response=self._snapshot()))
        return events

    def failed(self, error: ApiError) -> list[dict]:
        self.response.update(status="failed", output=self.output,
                             error={"code": error.code or error.type, "message": error.message})
        return [self._event("response.failed", response=self._snapshot())]


class ResponsesApi:
    def __init__(self, chat: OpenAIServing):
        self.chat = chat
        self.vision = isinstance(chat.images, ImageInputs)

    def _parse(self, body: bytes) -> tuple[ResponsesRequest, Turn]:
        req = decode_body(body, ResponsesRequest)
        chat, names = chat_request(req, self.vision)
        return req, prepare_turn(self.chat, chat, names)

    async def create(self, body: bytes) -> Response:
        req, turn = await asyncio.to_thread(self._parse, body)  # the chat template and tokenizer: off the loop
        shape = ResponseShape(req, turn, self.chat.limits.served_name)
        group = await submit_turn(self.chat, turn)
        if req.stream:
            return await streamed_turn(group, group_deltas(group), turn, shape)
        await whole_turn(group, group_deltas(group), turn, shape)
        return json_response(shape.response)
