"""OpenAI response shapes: completions and chat, whole responses and stream chunks, usage, logprobs.
Plain dicts, encoded once with msgspec; field order and nulls as OpenAI sends them."""
from __future__ import annotations

import time
import uuid
from typing import Optional

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.ipc.messages import TextDelta


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseHeader:
    """What every object of one response repeats: id, object type, created, model."""

    def __init__(self, kind: str, model: str, request_id: Optional[str] = None):
        """`request_id`: vLLM's, which names the response (`chatcmpl-<it>`); else a random one."""
        chat = kind == "chat"
        prefix = "chatcmpl" if chat else "cmpl"
        self.id = f"{prefix}-{request_id}" if request_id else new_response_id(prefix)
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.model = model

    def whole(self, choices: list[dict], usage_: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}

    def chunk(self, choices: list[dict], usage_: Optional[dict] = None, with_usage_field: bool = False) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": choices}
        if with_usage_field:  # with include_usage every chunk says usage: null but the last
            out["usage"] = usage_
        return out


class CompletionLogprobs:
    """Legacy completions logprobs: parallel lists; text_offset counts characters of the output."""

    def __init__(self, tokenizer: PromptTokenizer, start_offset: int = 0, token_ids_as_tokens: bool = False):
        """`token_ids_as_tokens` (vLLM's return_tokens_as_token_ids): tokens named "token_id:<id>"."""
        self.tokenizer = tokenizer
        self.offset = start_offset
        self.token_ids_as_tokens = token_ids_as_tokens

    def of(self, delta: TextDelta) -> dict:
        tok = self.tokenizer
        name = (lambda t: f"token_id:{t}") if self.token_ids_as_tokens else tok.token_text
        tokens, offsets, tops = [], [], []
        for i, token_id in enumerate(delta.token_ids):
            text = tok.token_text(token_id)
            tokens.append(name(token_id))
            offsets.append(self.offset)
            self.offset += len(text)
            ids = delta.top_ids[i] if i < len(delta.top_ids) else []
            lps = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
            tops.append({name(t): lp for t, lp in zip(ids, lps)})
        return {"tokens": tokens, "token_logprobs": list(delta.logprobs[:len(tokens)]),
                "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


def chat_logprobs(delta: TextDelta, tokenizer: PromptTokenizer, token_ids_as_tokens: bool = False) -> list[dict]:
    """Chat logprobs entries: token, logprob, bytes, top_logprobs [{token, logprob, bytes}];
    `token_ids_as_tokens` (vLLM's return_tokens_as_token_ids): tokens named "token_id:<id>"."""
    def entry(token_id: int, logprob: float) -> dict:
        name = f"token_id:{token_id}" if token_ids_as_tokens else tokenizer.token_text(token_id)
        return {"token": name, "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    out = []
    for i, (token_id, logprob) in enumerate(zip(delta.token_ids, delta.logprobs)):
        ids = delta.top_ids[i] if i < len(delta.top_ids) else []
        lps = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in zip(ids, lps)]
        out.append(item)
    return out


def completion_choice(index: int, text: str, logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: Optional[list], finish_reason: Optional[str]) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, logprobs: Optional[list], finish_reason: Optional[str]) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason}
