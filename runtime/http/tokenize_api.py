"""vLLM's POST /tokenize (a prompt, or chat messages through the template) and POST /detokenize, in
vLLM's request and response shapes: clients count tokens and check templates without generating."""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import msgspec
from quart import Response

from llaunch.runtime.http.chat_messages import chat_messages, template_options
from llaunch.runtime.web.errors import bad_request, json_response
from llaunch.runtime.http.openai_protocol import ChatMessage, Tool, check_model
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import RequestLimits, TokenId, check_prompt_text, check_token_id


class TokenizeCompletion(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: Optional[str] = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    model: Optional[str] = None
    tools: Optional[list[Tool]] = None
    add_generation_prompt: Optional[bool] = None  # default: true, unless continue_final_message
    continue_final_message: Optional[bool] = None
    chat_template: Optional[str] = None  # server.trust_request_chat_template
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, Any]]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None  # refused where set, as on chat completions
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: Optional[str] = None


class TokenizeApi:
    def __init__(self, tokenizer: PromptTokenizer, limits: RequestLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    async def tokenize(self, body: bytes) -> Response:
        return json_response(await asyncio.to_thread(self._tokenize, body))

    async def detokenize(self, body: bytes) -> Response:
        return json_response(await asyncio.to_thread(self._detokenize, body))

    def _tokenize(self, body: bytes) -> dict:
        chat = b'"messages"' in body  # the two shapes differ by this field (decode checks the rest)
        req = decode_body(body, TokenizeChat if chat else TokenizeCompletion)
        check_model(req.model, self.limits)
        tok = self.tokenizer
        if chat:
            if not req.messages:
                raise bad_request("`messages` must not be empty.", param="messages")
            if not tok.has_chat_template:
                raise bad_request("The served model's tokenizer has no chat template.", param="messages")
            if req.mm_processor_kwargs:
                raise bad_request("`mm_processor_kwargs` is not supported: the image processor's settings are the "
                                  "model's (visual.*).", param="mm_processor_kwargs")
            options = template_options(req, self.limits.trust_request_chat_template)
            messages, tools = chat_messages(req, tok.tool_format, tok.template_has_tools)
            check_prompt_text("".join(m["content"] for m in messages), self.limits, param="messages")
            try:
                ids = tok.encode_chat(messages, tools, add_special_tokens=req.add_special_tokens, **options)
            except Exception as e:  # the template may reject an order of roles
                raise bad_request(f"The chat template rejected the messages: {e}", param="messages") from None
        else:
            check_prompt_text(req.prompt, self.limits, param="prompt")
            ids = tok.encode(req.prompt) if req.add_special_tokens else tok.encode_plain(req.prompt)
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids,
                "token_strs": [tok.token_text(i) for i in ids] if req.return_token_strs else None}

    def _detokenize(self, body: bytes) -> dict:
        req = decode_body(body, DetokenizeRequest)
        check_model(req.model, self.limits)
        if len(req.tokens) > self.limits.max_model_len:
            raise bad_request(f"{len(req.tokens)} tokens; at most the context, {self.limits.max_model_len}.",
                              param="tokens")
        for t in req.tokens:
            check_token_id(t, self.limits, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}
