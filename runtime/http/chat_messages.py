"""A chat request's messages as the chat template takes them: text parts joined, earlier tool calls
and tool results in the template's own fields, or written out in the call format when the template
knows no tools (then the tools are described in a system message)."""
from __future__ import annotations

import json
from typing import Any, Optional

from llaunch.runtime.http.errors import bad_request
from llaunch.runtime.http.audio import AUDIO_PARTS, audio_placeholder, audio_source
from llaunch.runtime.http.images import IMAGE_PLACEHOLDER, image_url_of
from llaunch.runtime.http.tool_calls import call_text, openai_tools

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(m, i: int, image_urls: Optional[list] = None) -> str:
    """The message's text; a multimodal model's image_url parts become Qwen2-VL's image placeholder and
    their (url, param) go to `image_urls` (an audio model's input_audio/audio_url parts: Qwen2-Audio's
    clip text, their (AudioSource, param))."""
    if m.content is None or isinstance(m.content, str):
        if m.content is None and not m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}] has no content.", param=f"messages[{i}].content")
        return m.content or ""
    parts = []
    audio = getattr(image_urls, "audio", False)  # a MediaParts of an audio model (runtime/http/audio.py)
    for j, part in enumerate(m.content):
        if part.type in AUDIO_PARTS and audio:  # Qwen2-Audio's template text per clip, numbered over the request
            image_urls.append((audio_source(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]"))
            parts.append(audio_placeholder(len(image_urls)))
            continue
        if part.type == "image_url" and image_urls is not None and not audio:
            image_urls.append((image_url_of(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]"))
            parts.append(IMAGE_PLACEHOLDER)
            continue
        if part.type == "text" and part.text is None:
            raise bad_request(f"messages[{i}].content[{j}]: a text part needs `text`.",
                              param=f"messages[{i}].content[{j}].text")
        if part.type != "text":
            raise bad_request(f"messages[{i}]: only text content parts are supported, got {part.type!r}.",
                              param=f"messages[{i}].content")
        parts.append(part.text)
    return "".join(parts)


def chat_messages(req, fmt: str, template_has_tools: bool,
                  image_urls: Optional[list] = None) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for the chat template. A template without tools gets them described in a
    system message, earlier calls written out in the call format and tool results as tool turns."""
    messages, tools = [], openai_tools(req) or None
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}.",
                              param=f"messages[{i}].role")
        out: dict[str, Any] = {"role": m.role, "content": message_text(m, i, image_urls)}
        if m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments, i)) for c in m.tool_calls]
            if template_has_tools:
                out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
            else:
                out["content"] = "\n".join([out["content"], *(call_text(fmt, n, a) for n, a in calls)]).strip()
        if m.role == "tool":
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
            if not template_has_tools:
                out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
        messages.append(out)
    if tools and not template_has_tools:
        described = "\n".join(json.dumps(t["function"]) for t in tools)
        example = call_text(fmt, "<name>", {"<parameter>": "<value>"})
        system = (f"You can call these tools:\n{described}\nTo call one, answer with:\n{example}")
        if messages and messages[0]["role"] == "system":
            messages[0] = dict(messages[0], content=f"{messages[0]['content']}\n\n{system}")
        else:
            messages.insert(0, {"role": "system", "content": system})
        tools = None
    return messages, tools


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's decoder recurses
        raise bad_request(f"messages[{i}].tool_calls: arguments are not JSON.", param=f"messages[{i}].tool_calls") from None
