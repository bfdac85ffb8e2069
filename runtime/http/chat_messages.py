"""A chat request's messages as the chat template takes them: text parts joined, earlier tool calls
and tool results in the template's own fields, or written out in the call format when the template
knows no tools (then the tools are described in a system message)."""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.http.audio import AUDIO_PARTS, audio_source
from llaunch.runtime.http.images import image_url_of
from llaunch.runtime.http.tool_calls import call_text, openai_tools

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: OpenAI's older tool turn


# a media part as chat templates take it (transformers' processors pass these): Qwen2-VL's template
# matches type image or an `image` key, Qwen2-Audio's an `audio` key; the frontend finds the tokens the
# template writes for each (<|image_pad|>, <|AUDIO|>) and splices the media's tokens there
_IMAGE_PART = {"type": "image", "image": ""}
_AUDIO_PART = {"type": "audio", "audio": ""}


def message_text(m, i: int, image_urls: Optional[list] = None) -> str:
    """The message's text (a text-only model's: media parts are refused)."""
    content = message_content(m, i, image_urls)
    assert isinstance(content, str)
    return content


def message_content(m, i: int, image_urls: Optional[list] = None) -> Union[str, list[dict]]:
    """The message's content for the chat template: its text, or where a multimodal model's message has
    media parts, its parts in order (text parts and {"type": "image"} / {"type": "audio"}), so the
    checkpoint's own template writes each image's or clip's text as transformers renders it. The media
    parts' (url, param) go to `image_urls` (an audio model's input_audio/audio_url parts: (AudioSource, param))."""
    if m.content is None or isinstance(m.content, str):
        if m.content is None and not m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}] has no content.", param=f"messages[{i}].content")
        return m.content or ""
    parts: list[dict] = []
    audio = getattr(image_urls, "audio", False)  # a MediaParts of an audio model (runtime/http/audio.py)
    for j, part in enumerate(m.content):
        if part.type in AUDIO_PARTS and audio:
            image_urls.append((audio_source(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]"))
            parts.append(dict(_AUDIO_PART))
            continue
        if part.type == "image_url" and image_urls is not None and not audio:
            image_urls.append((image_url_of(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]"))
            parts.append(dict(_IMAGE_PART))
            continue
        if part.type == "text" and part.text is None:
            raise bad_request(f"messages[{i}].content[{j}]: a text part needs `text`.",
                              param=f"messages[{i}].content[{j}].text")
        if part.type != "text":
            raise bad_request(f"messages[{i}]: only text content parts are supported, got {part.type!r}.",
                              param=f"messages[{i}].content")
        parts.append({"type": "text", "text": part.text})
    if any(p["type"] != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def content_text(content: Union[str, list[dict]]) -> str:
    """A template message's text (its text parts where it has media)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _with_text(content: Union[str, list[dict]], text: str) -> Union[str, list[dict]]:
    """The content followed by a line of text (a call written out after a message's own content)."""
    if isinstance(content, str):
        return "\n".join([content, text]).strip()
    return [*content, {"type": "text", "text": "\n" + text}]


# apply_chat_template's own arguments: a request sets them through its fields, not chat_template_kwargs
_TEMPLATE_ARGUMENTS = {"add_generation_prompt": "add_generation_prompt", "continue_final_message":
                       "continue_final_message", "tools": "tools", "documents": "documents",
                       "chat_template": "chat_template", "messages": "messages", "conversation": "messages"}
_TOKENIZER_ARGUMENTS = ("tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                        "return_assistant_tokens_mask", "tokenizer_kwargs")


def template_options(req, trust_request_template: bool) -> dict[str, Any]:
    """The chat template's arguments beyond messages and tools: vLLM's add_generation_prompt,
    continue_final_message, documents, chat_template and chat_template_kwargs, LightLLM's role_settings
    (the template's `role_setting`) and character_settings."""
    kwargs: dict[str, Any] = {}
    for key, value in (getattr(req, "chat_template_kwargs", None) or {}).items():
        if key in _TEMPLATE_ARGUMENTS or key in _TOKENIZER_ARGUMENTS:
            use = f"; set `{_TEMPLATE_ARGUMENTS[key]}` instead" if key in _TEMPLATE_ARGUMENTS else ""
            raise bad_request(f"chat_template_kwargs.{key} is an argument of the template call, not a template "
                              f"variable{use}.", param=f"chat_template_kwargs.{key}")
        kwargs[key] = value
    if getattr(req, "role_settings", None) is not None:
        kwargs["role_setting"] = req.role_settings
    if getattr(req, "character_settings", None) is not None:
        kwargs["character_settings"] = req.character_settings
    continue_final = bool(getattr(req, "continue_final_message", None))
    add_generation = getattr(req, "add_generation_prompt", None)
    if continue_final and add_generation:
        raise bad_request("Set `continue_final_message` or `add_generation_prompt`, not both.",
                          param="continue_final_message")
    if continue_final and req.messages and req.messages[-1].role != "assistant":
        raise bad_request("`continue_final_message` continues the last message, which must be the assistant's.",
                          param="continue_final_message")
    options: dict[str, Any] = {"add_generation_prompt": not continue_final if add_generation is None else add_generation,
                               "continue_final_message": continue_final, "template_kwargs": kwargs}
    if getattr(req, "documents", None) is not None:
        options["documents"] = req.documents
    if getattr(req, "chat_template", None) is not None:
        if not trust_request_template:
            raise bad_request("`chat_template`: this server renders only the model's own chat template "
                              "(server.trust_request_chat_template=false).", param="chat_template")
        options["chat_template"] = req.chat_template
    return options


def chat_messages(req, fmt: str, template_has_tools: bool,
                  image_urls: Optional[list] = None) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for the chat template. A template without tools gets them described in a
    system message, earlier calls written out in the call format and tool results as tool turns.
    TGI's `tool_prompt` introduces the tools: in that system message, or joining the system message
    where the template writes the tools itself."""
    messages, tools = [], openai_tools(req) or None
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}.",
                              param=f"messages[{i}].role")
        if getattr(m, "audio", None) is not None:
            raise bad_request(f"messages[{i}].audio is not supported: the served models output text only.",
                              param=f"messages[{i}].audio")
        role = "tool" if m.role == "function" else m.role
        out: dict[str, Any] = {"role": role, "content": message_content(m, i, image_urls)}
        called = [c.function for c in m.tool_calls or []]
        if getattr(m, "function_call", None) is not None:  # OpenAI's older form of one call
            called.append(m.function_call)
        if called:
            calls = [(c.name, _arguments(c.arguments, i)) for c in called]
            if template_has_tools:
                out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
            else:
                out["content"] = _with_text(out["content"], "\n".join(call_text(fmt, n, a) for n, a in calls))
        if role == "tool":
            if m.role == "function" and m.name:
                out["name"] = m.name
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
            if not template_has_tools:
                out["content"] = f"<tool_response>\n{content_text(out['content'])}\n</tool_response>"
        messages.append(out)
    intro = getattr(req, "tool_prompt", None)
    if tools and not template_has_tools:
        described = "\n".join(json.dumps(t["function"]) for t in tools)
        example = call_text(fmt, "<name>", {"<parameter>": "<value>"})
        _join_system(messages, f"{intro or 'You can call these tools:'}\n{described}\nTo call one, answer with:\n{example}")
        tools = None
    elif tools and intro:
        _join_system(messages, intro)
    return messages, tools


def _join_system(messages: list[dict], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        messages[0] = dict(messages[0], content=f"{content}\n\n{text}" if isinstance(content, str)
                           else [*content, {"type": "text", "text": f"\n\n{text}"}])
    else:
        messages.insert(0, {"role": "system", "content": text})


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's decoder recurses
        raise bad_request(f"messages[{i}].tool_calls: arguments are not JSON.", param=f"messages[{i}].tool_calls") from None
