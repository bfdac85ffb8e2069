"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, served through the chat
path (runtime/http/chat_turn.py). `system` and `messages` (text, image, tool_use and tool_result
blocks) become chat messages, a final assistant message is continued (Anthropic's prefill); `tools`
(name, description, input_schema), `tool_choice` (auto, any, tool, none), `max_tokens` (required, as
Anthropic requires), `stop_sequences`, `temperature`, `top_p`, `top_k` and `output_config.format`
(structured output) become the chat request's fields. The answer is text and tool_use blocks (and a
thinking model's thinking block where server.reasoning_parser splits it off) with
stop_reason end_turn, max_tokens, stop_sequence or tool_use, whole or streamed as Anthropic streams it
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Every error is in
Anthropic's shape ({"type": "error", "error": {"type", "message"}}), also those the app's guards give.

Usage counts as Anthropic's does: `input_tokens` the prompt tokens computed, `cache_read_input_tokens`
those the prefix cache served (their sum is the prompt)."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any, AsyncIterator, Optional, Union

import msgspec
from quart import Quart, Response, request

from llaunch.runtime.config import ReasoningParser
from llaunch.runtime.http.chat_turn import (ErrorNames, Part, Thought, Turn, group_deltas, prepare_turn,
                                            streamed_turn, submit_turn, whole_turn)
from llaunch.runtime.web.errors import ApiError, bad_request, json_response
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.http.openai_protocol import (ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall,
                                                  FunctionDefinition, ImageUrl, JsonSchemaFormat, ResponseFormat,
                                                  Tool, ToolCall)
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.openai_serving import ChoiceState, OpenAIServing
from llaunch.runtime.http.request_limits import TokenCount, TopP
from llaunch.runtime.ipc.messages import SamplingParams, TextDelta

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # Anthropic's range
TopK = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # 0: off
_NAMES = [(r"response_format\.json_schema\.schema", "output_config.format.schema"),
          (r"response_format(\.json_schema)?", "output_config.format"), (r"max_completion_tokens", "max_tokens"),
          (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
          (r"tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"`stop(\[\d+\])?`", r"`stop_sequences\1`"),
          (r"^stop(\[\d+\])?$", r"stop_sequences\1")]
_SERVER_TOOLS = "llaunch runs no tools itself; define a client tool (name, description, input_schema) and run it"
# Anthropic's error types by status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


class ImageSource(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # base64 | url (http(s) is never fetched) | file (refused: no file store)
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None
    file_id: Optional[str] = None


class ResultBlock(msgspec.Struct, forbid_unknown_fields=True):
    """A block of a tool_result's content: text or image."""

    type: str
    text: Optional[str] = None
    source: Optional[ImageSource] = None
    cache_control: Optional[dict[str, Any]] = None  # the prefix cache is automatic: accepted, unused
    citations: Optional[Any] = None


class Block(msgspec.Struct, forbid_unknown_fields=True):
    """A message's content block: text, image, tool_use (an assistant's call), tool_result (the user's
    result of one), thinking (an earlier answer's: dropped); documents are refused."""

    type: str
    text: Optional[str] = None
    source: Optional[ImageSource] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list[ResultBlock], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = None
    citations: Optional[Any] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None


class AnthropicMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str  # user | assistant
    content: Union[str, list[Block]]


class CustomTool(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    input_schema: dict[str, Any]
    description: Optional[str] = None
    type: Optional[str] = None  # custom (or unset)
    cache_control: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # the grammar always holds a call to its schema
    defer_loading: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None
    input_examples: Optional[list[Any]] = None
    allowed_callers: Optional[list[str]] = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # auto | any | tool | none
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # json_schema
    schema: Optional[dict[str, Any]] = None


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None  # the served models do not reason: accepted without effect


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[AnthropicMessage]
    system: Union[str, list[ResultBlock], None] = None  # text blocks
    # each checked on its own: a server tool is refused for what it is, whatever its other fields
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[dict[str, Any]] = None  # enabled: 400 unless server.reasoning_parser splits thoughts off
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict[str, Any]] = None  # the prefix cache is automatic: accepted, unused
    # refused where set: they need what llaunch does not run
    mcp_servers: Optional[list[Any]] = None
    context_management: Optional[dict[str, Any]] = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: TokenCount
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    # accepted without effect
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    container: Union[str, dict[str, Any], None] = None  # refused: no code execution


def _refuse_unserved(req: CountTokensRequest, thinks: bool) -> None:
    """`thinks`: the server splits a thinking model's reasoning off (server.reasoning_parser), which comes
    back as thinking blocks whatever `thinking` says (the chat template decides whether the model thinks)."""
    thinking = (req.thinking or {}).get("type")
    if thinking not in (None, "disabled", "adaptive") and not thinks:
        raise bad_request(f"thinking {thinking!r} is not supported: the served model's reasoning is not split off "
                          "(server.reasoning_parser=none); leave it unset or disabled.", param="thinking")
    if req.mcp_servers:
        raise bad_request(f"`mcp_servers` is not supported: {_SERVER_TOOLS}.", param="mcp_servers")
    if req.context_management is not None:
        raise bad_request("`context_management` is not supported: llaunch edits no conversation; send the "
                          "messages to keep.", param="context_management")
    if getattr(req, "container", None) is not None:
        raise bad_request("`container` is not supported: llaunch runs no code.", param="container")


def _image(source: Optional[ImageSource], where: str, vision: bool) -> ContentPart:
    if not vision:
        raise bad_request(f"{where}: the served model reads text only (image blocks need a vision model: "
                          "Qwen2-VL, Qwen2.5-VL).", param=where)
    if source is None or source.type not in ("base64", "url"):
        raise bad_request(f"{where}: an image needs a base64 or url `source` (llaunch keeps no files).",
                          param=f"{where}.source")
    url = f"data:{source.media_type};base64,{source.data}" if source.type == "base64" else source.url
    return ContentPart(type="image_url", image_url=ImageUrl(url=url or ""))


def _text_or_image(block: Union[Block, ResultBlock], where: str, vision: bool) -> ContentPart:
    if block.type == "text":
        if block.text is None:
            raise bad_request(f"{where}: a text block needs `text`.", param=f"{where}.text")
        return ContentPart(type="text", text=block.text)
    if block.type == "image":
        return _image(block.source, where, vision)
    why = f"text, image, tool_use, tool_result and thinking are served; {_SERVER_TOOLS}"
    raise bad_request(f"{where}: blocks of type {block.type!r} are not supported: {why}.", param=f"{where}.type")


def _system(system: Union[str, list[ResultBlock], None]) -> Optional[str]:
    if system is None or isinstance(system, str):
        return system
    for j, block in enumerate(system):
        if block.type != "text" or block.text is None:
            raise bad_request(f"system[{j}]: the system prompt takes text blocks only.", param=f"system[{j}]")
    return "".join(block.text for block in system)


def _messages(req: CountTokensRequest, vision: bool) -> tuple[list[ChatMessage], list[str]]:
    """(chat messages, where each came from): an assistant message's tool_use blocks are its tool calls,
    a user message's tool_result blocks tool turns before the rest of it."""
    messages, origins = [], []
    system = _system(req.system)
    if system is not None:
        messages.append(ChatMessage(role="system", content=system))
        origins.append("system")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"{where}.role {m.role!r} is not one of user, assistant (the system prompt is "
                              "`system`).", param=f"{where}.role")
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            origins.append(where)
            continue
        parts, calls = [], []
        for j, block in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if block.type == "tool_use" and m.role == "assistant":
                if not block.id or not block.name:
                    raise bad_request(f"{at}: a tool_use block needs `id` and `name`.", param=at)
                calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                         arguments=json.dumps(block.input or {}))))
            elif block.type == "tool_result" and m.role == "user":
                if not block.tool_use_id:
                    raise bad_request(f"{at}: a tool_result block needs `tool_use_id`.", param=f"{at}.tool_use_id")
                content = block.content if isinstance(block.content, str) or block.content is None else [
                    _text_or_image(b, f"{at}.content[{k}]", vision) for k, b in enumerate(block.content)]
                messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=content or ""))
                origins.append(at)
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # an earlier answer's thoughts: dropped, as chat templates drop them (Qwen3's)
            elif block.type in ("tool_use", "tool_result"):
                raise bad_request(f"{at}: a {block.type} block belongs in a message of the "
                                  f"{'assistant' if block.type == 'tool_use' else 'user'}.", param=f"{at}.type")
            else:
                parts.append(_text_or_image(block, at, vision))
        if parts or calls or not m.content:
            content = parts if parts else None if calls else ""
            messages.append(ChatMessage(role=m.role, content=content, tool_calls=calls or None))
            origins.append(where)
    return messages, origins


def _tools(req: CountTokensRequest) -> Optional[list[Tool]]:
    if req.tools is None:
        return None
    tools = []
    for i, raw in enumerate(req.tools):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"tools[{i}]: the server tool {kind!r} is not supported: {_SERVER_TOOLS}.",
                              param=f"tools[{i}].type")
        t = decode_body(msgspec.json.encode(raw), CustomTool, where=f"tools[{i}]")
        tools.append(Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                                        parameters=t.input_schema)))
    return tools


def _tool_choice(choice: Optional[ToolChoice]) -> tuple[Union[str, dict, None], Optional[bool]]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs `name`.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if chat is None:
        raise bad_request(f"tool_choice.type {choice.type!r} is not one of auto, any, tool, none.",
                          param="tool_choice.type")
    return chat, parallel


def _response_format(config: Optional[OutputConfig]) -> Optional[ResponseFormat]:
    fmt = config.format if config is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema" or fmt.schema is None:
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                          param="output_config.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema))


def chat_request(req: CountTokensRequest, vision: bool, thinks: bool) -> tuple[ChatCompletionRequest, ErrorNames]:
    """The chat request that serves `req`, and the names its errors translate back to. A final
    assistant message without tool calls is continued (Anthropic's prefill)."""
    _refuse_unserved(req, thinks)
    messages, origins = _messages(req, vision)
    prefill = bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls
    tool_choice, parallel = _tool_choice(req.tool_choice)
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = dict(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    chat = ChatCompletionRequest(model=req.model, messages=messages, tools=_tools(req), tool_choice=tool_choice,
                                 parallel_tool_calls=parallel, response_format=_response_format(req.output_config),
                                 continue_final_message=prefill or None, **fields)
    return chat, ErrorNames(_NAMES, origins)


def _keep_stop_sequence(sampling: SamplingParams) -> SamplingParams:
    """The detokenizer keeps the stop sequence that ends the text, so the last delta names it
    (stop_sequence); it is cut off before the client sees it (`trimmed`)."""
    return msgspec.structs.replace(sampling, include_stop_str_in_output=True)


async def trimmed(deltas: AsyncIterator[TextDelta], stops: list[str],
                  shape: "MessageShape") -> AsyncIterator[TextDelta]:
    async for delta in deltas:
        if delta.stopped_by_string:
            hit = max((s for s in stops if s and delta.text.endswith(s)), key=len, default=None)
            if hit is not None:
                shape.stop_sequence = hit
                delta = msgspec.structs.replace(delta, text=delta.text[:-len(hit)])
        yield delta


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessageShape:
    """The Message object and its stream events for one turn (chat_turn.TurnShape)."""

    def __init__(self, model: str, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.message: dict[str, Any] = {"id": _new_id("msg"), "type": "message", "role": "assistant", "model": model,
                                        "content": [], "stop_reason": None, "stop_sequence": None,
                                        "usage": self._usage(0, 0)}
        self.open: Optional[dict] = None  # the text or thinking block being written
        self.stop_sequence: Optional[str] = None  # set by `trimmed`

    def _usage(self, cached: int, output: int) -> dict:
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output}

    def opened(self, state: ChoiceState) -> list[dict]:
        self.message["usage"] = self._usage(state.cached_tokens, 0)
        return [{"type": "message_start", "message": dict(self.message, content=[])}]

    def part(self, part: Part) -> list[dict]:
        if isinstance(part, Thought):
            return self._write("thinking", part.text)
        if isinstance(part, str):
            return self._write("text", part)
        events = self._close()
        blocks = self.message["content"]
        call_id = "toolu_" + part.id.removeprefix("call_")
        blocks.append({"type": "tool_use", "id": call_id, "name": part.name, "input": json.loads(part.arguments)})
        index = len(blocks) - 1
        return events + [
            {"type": "content_block_start", "index": index,
             "content_block": {"type": "tool_use", "id": call_id, "name": part.name, "input": {}}},
            {"type": "content_block_delta", "index": index,
             "delta": {"type": "input_json_delta", "partial_json": part.arguments}},
            {"type": "content_block_stop", "index": index}]

    def _write(self, kind: str, text: str) -> list[dict]:
        """Text into the open block of `kind` (text, or thinking: a thinking model's reasoning, unsigned)."""
        blocks, events = self.message["content"], []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                             "signature": ""}
            blocks.append(self.open)
            events.append({"type": "content_block_start", "index": len(blocks) - 1, "content_block": dict(self.open)})
        self.open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(blocks) - 1, "delta": delta}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.message["content"]) - 1}]

    def finished(self, state: ChoiceState) -> list[dict]:
        events = self._close()
        called = any(b["type"] == "tool_use" for b in self.message["content"])
        reason = ("max_tokens" if state.finish_reason == "length" else "stop_sequence" if self.stop_sequence
                  else "tool_use" if called else "end_turn")
        usage = self._usage(state.cached_tokens, state.completion_tokens)
        self.message.update(stop_reason=reason, stop_sequence=self.stop_sequence, usage=usage)
        delta = {"stop_reason": reason, "stop_sequence": self.stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": usage},
                         {"type": "message_stop"}]

    def failed(self, error: ApiError) -> list[dict]:
        return [error_body(error)]


def error_body(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def anthropic_errors(app: Quart) -> None:
    """Errors on PATHS in Anthropic's shape, whoever answered them (the route, the API-key and drain
    guards, a body over the size limit): the app answers every error in OpenAI's shape first."""

    @app.after_request
    async def reshape(response: Response) -> Response:
        if request.path not in PATHS or response.status_code < 400 or response.mimetype != "application/json":
            return response
        body = json.loads(await response.get_data())
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and body.get("type") != "error":
            message = error.get("message", "")
            param = error.get("param")
            if param and param not in message:
                message = f"{message} (field: {param})"
            reshaped = error_body(ApiError(response.status_code, message))
            response.set_data(msgspec.json.encode(reshaped))
        return response


class AnthropicApi:
    def __init__(self, chat: OpenAIServing):
        self.chat = chat
        self.vision = isinstance(chat.images, ImageInputs)
        self.thinks = chat.limits.reasoning_parser != ReasoningParser.none.value

    def _parse(self, body: bytes) -> tuple[MessagesRequest, Turn]:
        req = decode_body(body, MessagesRequest)
        chat, names = chat_request(req, self.vision, self.thinks)
        return req, prepare_turn(self.chat, chat, names, _keep_stop_sequence if req.stop_sequences else None)

    async def messages(self, body: bytes) -> Response:
        req, turn = await asyncio.to_thread(self._parse, body)  # the chat template and tokenizer: off the loop
        shape = MessageShape(self.chat.limits.served_name, len(turn.prompt_ids))
        group = await submit_turn(self.chat, turn)
        deltas = trimmed(group_deltas(group), req.stop_sequences or [], shape)
        if req.stream:
            return await streamed_turn(group, deltas, turn, shape)
        await whole_turn(group, deltas, turn, shape)
        return json_response(shape.message)

    def _count(self, body: bytes) -> int:
        req = decode_body(body, CountTokensRequest)
        chat, names = chat_request(req, self.vision, self.thinks)
        try:
            prompt_ids, _ = self.chat.chat_prompt_ids(chat)
        except ApiError as e:
            raise names.error(e) from None
        return len(prompt_ids)

    async def count_tokens(self, body: bytes) -> Response:
        return json_response({"input_tokens": await asyncio.to_thread(self._count, body)})
