"""OpenAI tool calling: the grammar (a structural tag) keeps every call valid JSON with the tool's
arguments schema and makes `required` / a named choice mean it, and the generated text is parsed back
into `tool_calls`, whole or as stream deltas. (How the tools reach the prompt: chat_messages.py.)

Two call formats, one per family of templates: `hermes` (Qwen2/2.5 and most chat models:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and `llama3_json` (Llama 3:
`{"name": ..., "parameters": {...}}`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.ipc.messages import Constraint

FORMATS = ("hermes", "llama3_json")
# whitespace characters in a row between a call's JSON tokens: room for indented JSON, none for a runaway
# (a model that prefers whitespace to the text it means loops on grammar-legal whitespace to max_tokens:
# vLLM #38696, SGLang #8250; structured output's JSON allows none, runtime/constrained/compiler.py)
MAX_CALL_WHITESPACE = 16
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "llama3_json": "llama"}  # xgrammar's names of the same formats
_ARGUMENTS_KEY = {"hermes": "arguments", "llama3_json": "parameters"}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def template_format(chat_template: Optional[str], configured: Optional[str]) -> str:
    """The call format: server.tool_call_format, else the one the chat template speaks."""
    if configured:
        return configured
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def tool_format_of(req, tokenizer) -> Optional[str]:
    """The call format to parse the answer with: the tokenizer's, when the request offers tools."""
    return tokenizer.tool_format if req.tools and req.tool_choice != "none" else None


def openai_tools(req) -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in (("name", t.function.name),
                                                                ("description", t.function.description),
                                                                ("parameters", t.function.parameters)) if v is not None}}
            for t in req.tools or []]


def tool_choice_of(req) -> Any:
    """The request's tool_choice, checked: none | auto | required | a named function of its tools."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {choice!r} is not one of none, auto, required or a named function.",
                              param="tool_choice")
        return choice
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not name or name not in {t.function.name for t in req.tools or []}:
        raise bad_request("tool_choice names no function among `tools`: give "
                          '{"type": "function", "function": {"name": ...}} with one of them.', param="tool_choice")
    return {"type": "function", "function": {"name": name}}


def tools_constraint(req, fmt: str) -> Optional[Constraint]:
    """The structural tag that keeps calls valid (auto), or demands them (required, named)."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs `tools`.", param="tool_choice")
        return None
    names = set()
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise bad_request(f"tools of type {t.type!r} are not supported (function only).", param="tools")
        if not t.function.name or t.function.name in names:  # a call names the function it calls
            raise bad_request(f"tools[{i}].function.name {t.function.name!r} is empty or given twice.",
                              param=f"tools[{i}].function.name")
        names.add(t.function.name)
    choice = tool_choice_of(req)
    if choice == "none":
        return None
    import xgrammar as xgr

    parallel = req.parallel_tool_calls is not False
    tag = xgr.get_model_structural_tag(_XGRAMMAR_MODEL[fmt], tools=openai_tools(req), tool_choice=choice,
                                       reasoning=False, parallel_tool_calls=parallel).model_dump()
    _bound_whitespace(tag)
    if choice == "required" and tag["format"]["type"] == "triggered_tags":
        # xgrammar's `required` still lets text come first (a call may never fit): calls only, at once
        tag["format"] = {"type": "tags_with_separator", "tags": tag["format"]["tags"], "separator": "\n",
                         "at_least_one": True, "stop_after_first": not parallel}
    return Constraint("structural_tag", json.dumps(tag))


def _bound_whitespace(node: Any) -> None:
    """Every JSON content of the structural tag allows MAX_CALL_WHITESPACE whitespace characters in a row."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = MAX_CALL_WHITESPACE
        for value in node.values():
            _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


def call_text(fmt: str, name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, _ARGUMENTS_KEY[fmt]: arguments})
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(fmt: str, body: str) -> Optional[ParsedCall]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # the model's output may nest deeper than the decoder recurses
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ParsedCall(obj["name"], json.dumps(obj.get(_ARGUMENTS_KEY[fmt], obj.get("arguments", {}))))


def _llama_calls(text: str) -> list[tuple[int, int, ParsedCall]]:
    """(start, end, call) of each `{"name": ...}` object in the text."""
    found, decoder, at = [], json.JSONDecoder(), 0
    while (start := text.find('{"name"', at)) >= 0:
        try:
            _, end = decoder.raw_decode(text, start)
        except ValueError:
            break
        call = _call_of("llama3_json", text[start:end])
        if call is not None:
            found.append((start, end, call))
        at = end
    return found


def parse_tool_calls(text: str, fmt: str, cut: bool = False) -> tuple[Optional[str], list[ParsedCall]]:
    """(the text that is not a call, or None when nothing else was said; the calls). `cut`: the
    output ended at its length limit, so an opened call that did not close is a call cut short: not
    content, and not a call either (its arguments are not JSON, which clients parse and send back);
    finish_reason length says what happened."""
    if fmt == "hermes":
        spans = [(m.start(), m.end(), _call_of(fmt, m.group(1))) for m in _HERMES_CALL.finditer(text)]
    else:
        spans = _llama_calls(text)
    spans = [(a, b, c) for a, b, c in spans if c is not None]
    if cut:
        opener = "<tool_call>" if fmt == "hermes" else '{"name"'
        start = text.find(opener, spans[-1][1] if spans else 0)
        if start < 0 and _longest_prefix_tail(text, opener):  # cut inside the opener itself
            start = len(text) - _longest_prefix_tail(text, opener)
        if start >= 0:
            spans.append((start, len(text), None))
    if not spans:
        return text.strip(), []  # stripped as the stream sends it (whitespace may precede a call)
    rest, at = [], 0
    for start, end, _ in spans:
        rest.append(text[at:start])
        at = end
    rest.append(text[at:])
    content = "".join(rest).strip()
    return content or None, [c for _, _, c in spans if c is not None]


class ToolCallStream:
    """Streamed text → content and calls (`parts`), or OpenAI's chat deltas of them (`feed`: the first
    delta of a call carries its index, id, type and name; the next its arguments). Text that may be the
    start of a call is held back until it is one or cannot become one."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.opener = "<tool_call>" if fmt == "hermes" else '{"name"'
        self.buffer = ""
        self.calls = 0
        self._space = ""  # whitespace held back: sent only when more content follows it
        self._started = False  # some content was sent (whitespace before it is dropped)

    def feed(self, text: str) -> list[dict]:
        """Deltas for `text`: {"content": str} or {"tool_calls": [...]}."""
        return self._deltas(self.parts(text))

    def parts(self, text: str) -> list[Union[str, ParsedCall]]:
        """`text` as the parts it completes, in order: content (str) and calls (ParsedCall); the other
        dialects (runtime/http/chat_turn.py) shape these their own way."""
        self.buffer += text
        out: list[Union[str, ParsedCall]] = []
        while self.buffer:
            start = self.buffer.find(self.opener)
            if start < 0:
                keep = _longest_prefix_tail(self.buffer, self.opener)
                if len(self.buffer) > keep:
                    out += self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if start > 0:
                out += self._content(self.buffer[:start])
                self.buffer = self.buffer[start:]
            span = self._complete_call()
            if span is None:
                return out  # the call is not finished yet
            end, call = span
            whole, self.buffer = self.buffer[:end], self.buffer[end:]
            out += self._content(whole) if call is None else [call]  # not a call: plain text
        return out

    def _content(self, text: str) -> list[str]:
        """Content as the whole-text parse has it: no whitespace before the first or after the last."""
        body = text.rstrip()
        if not body.strip():
            self._space += text
            return []
        send = self._space + body if self._started else body.lstrip()
        self._space, self._started = text[len(body):], True
        return [send]

    def _complete_call(self) -> Optional[tuple[int, Optional[ParsedCall]]]:
        if self.fmt == "hermes":
            end = self.buffer.find("</tool_call>")
            if end < 0:
                return None
            end += len("</tool_call>")
            match = _HERMES_CALL.match(self.buffer[:end])
            return end, _call_of(self.fmt, match.group(1)) if match else None
        try:
            _, end = json.JSONDecoder().raw_decode(self.buffer)
        except ValueError:
            return None
        return end, _call_of(self.fmt, self.buffer[:end])

    def _deltas(self, parts: list[Union[str, ParsedCall]]) -> list[dict]:
        out: list[dict] = []
        for part in parts:
            if isinstance(part, str):
                out.append({"content": part})
                continue
            index, self.calls = self.calls, self.calls + 1
            out += [{"tool_calls": [{"index": index, "id": part.id, "type": "function",
                                     "function": {"name": part.name, "arguments": ""}}]},
                    {"tool_calls": [{"index": index, "function": {"arguments": part.arguments}}]}]
        return out

    def finish(self, cut: bool = False) -> list[dict]:
        return self._deltas(self.finish_parts(cut))

    def finish_parts(self, cut: bool = False) -> list[str]:
        """The text is over: what was held back is content, except with `cut` (the length limit ended
        it) a call that opened and did not close: a call cut short, dropped (see parse_tool_calls)."""
        text, self.buffer = self.buffer, ""
        if cut and (text.startswith(self.opener) or self.opener.startswith(text)):
            return []
        return self._content(text)


def _longest_prefix_tail(text: str, opener: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `opener`."""
    for k in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:k]):
            return k
    return 0
