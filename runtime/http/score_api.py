"""The score endpoints of a score model (model.task=score: a *ForSequenceClassification head, LightLLM's
use_reward_model, or a yes/no reranker): LightLLM's POST /get_score, vLLM's POST /classify and POST /v1/score (and
/score), in their request and response shapes (the rerank routes: runtime/http/rerank_api.py). Each prompt is one
prefill whose last token's head outputs come back as TextDelta.scores; the generation routes are refused on such a
model, and these on a generating one."""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.http.chat_messages import message_text
from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.web.errors import ApiError, bad_request, engine_failed, json_response
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.openai_protocol import ChatMessage, check_model
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (RequestLimits, TokenId, check_fan_out, check_prompt_text,
                                                 max_new_tokens_for)
from llaunch.runtime.ipc.messages import SamplingParams

SCORE_PATHS = ("/get_score", "/classify", "/v1/classify", "/v1/score", "/score")
# what a score model cannot serve: every route that samples tokens ("/": server.tgi_api's compat route)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate",
                    "/generate_stream", "/")
_ONE_PREFILL = SamplingParams(max_new_tokens=1, temperature=0.0)  # the router runs the prompt; no token is sampled
# Qwen3-Reranker's documented prompt (its model card): a yes/no head judges the document under an instruction
YES_NO_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES_NO_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class ScoreHead:
    """What the frontend knows of the served score head (the launcher derived it from config.json)."""

    labels: tuple[str, ...]
    pad_token_id: Optional[int] = None  # transformers pools the last token that is not this one
    yes_no: bool = False  # a yes/no reranker (model.score_head=yes_no): pairs go through its documented prompt

    @staticmethod
    def of(model: ModelConfig) -> Optional["ScoreHead"]:
        if getattr(model.task, "value", model.task) != "score":
            return None
        labels = model.labels or [f"LABEL_{i}" for i in range(model.num_labels or 0)]
        return ScoreHead(labels=tuple(labels), pad_token_id=model.pad_token_id,
                         yes_no=getattr(model.score_head, "value", model.score_head) == "yes_no")

    def pooled(self, ids: list[int]) -> list[int]:
        """The prompt up to the token transformers pools: trailing pad tokens dropped (all pads: the first)."""
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad_token_id:
            end -= 1
        return ids[:end]


def score_model_refusal(path: str) -> ApiError:
    return bad_request(f"{path} generates text, but the served model is a score model (model.task=score: a "
                       f"classification / reward head, no LM head); use {', '.join(SCORE_PATHS[:4])}.",
                       code="score_model")


def _no_head(path: str, task: str) -> ApiError:
    what = ("generates (model.task=generate: no classification / reward head)" if task == "generate" else
            f"is not a score model (model.task={task})")
    return bad_request(f"{path} needs a score model, but the served model {what}; serve a *ForSequenceClassification "
                       "checkpoint, or a yes/no reranker (model.score_head=yes_no).", code="not_a_score_model")


async def prefill_outputs(engine: EngineClient, lifecycle: Lifecycle, path: str,
                          prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's outputs (a score head's, or an embedding model's pooled hidden state), in order."""
    group = await engine.submit([(p, _ONE_PREFILL) for p in prompts], lifecycle=lifecycle)
    out: list[Optional[list[float]]] = [None] * len(prompts)
    try:
        async for i, delta in group:
            if delta.finish_reason not in (None, "stop", "length"):
                raise engine_failed(delta.finish_reason, delta.error)
            out[i] = delta.scores or out[i]
    finally:
        await group.close()
    if any(s is None for s in out):
        raise engine_failed("error", f"{path}: the engine returned no outputs")
    return out


class GetScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    chat: Union[str, list[ChatMessage]]  # LightLLM: the chat template's text; also messages, templated here
    multimodal_params: Optional[dict[str, Any]] = None  # LightLLM's; text only here


Inputs = Union[str, list[Union[str, TokenId, list[TokenId]]]]  # a text, texts, token ids, lists of token ids


def input_prompts(x: Inputs) -> list[Union[str, list[TokenId]]]:
    """OpenAI's `input`, one entry per prompt: a text, texts, one list of token ids, or lists of them."""
    if isinstance(x, str):
        x = [x]
    if x and all(isinstance(t, int) for t in x):
        x = [x]  # one prompt of token ids
    elif any(isinstance(t, int) for t in x):
        raise bad_request("`input` mixes token ids with texts or id lists.", param="input")
    if not x:
        raise bad_request("`input` must not be empty.", param="input")
    return x


class ClassifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: Inputs
    model: Optional[str] = None
    user: Optional[str] = None
    add_special_tokens: bool = True


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    model: Optional[str] = None
    user: Optional[str] = None


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def class_probs(scores: list[float]) -> list[float]:
    """vLLM's classification activation: sigmoid for one output, softmax over several."""
    if len(scores) == 1:
        return [_sigmoid(scores[0])]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    return [e / sum(exps) for e in exps]


class ScoreApi:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle,
                 head: Optional[ScoreHead], task: str = "generate"):
        """`task`: the served model's model.task, which a refusal names when `head` is None."""
        self.engine, self.tokenizer, self.limits, self.lifecycle, self.head = engine, tokenizer, limits, lifecycle, head
        self.task = task

    async def scores(self, path: str, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's head outputs (fp32 logits), in order."""
        return await prefill_outputs(self.engine, self.lifecycle, path, [self.head.pooled(p) for p in prompts])

    def pair_prompt(self, query: str, document: str, instruction: Optional[str] = None) -> list[int]:
        """A (query, document) pair as the head reads it: a cross-encoder's through the tokenizer's pair encoding,
        a yes/no reranker's in its documented prompt (prefix, pair and suffix tokenized apart, as its card does)."""
        if not self.head.yes_no:
            return self.tokenizer.encode_pair(query, document)
        pair = f"<Instruct>: {instruction or YES_NO_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        return [*self.tokenizer.encode_plain(YES_NO_PREFIX), *self.tokenizer.encode_plain(pair),
                *self.tokenizer.encode_plain(YES_NO_SUFFIX)]

    def one_output(self, path: str) -> None:
        """A relevance is one number: a head of several outputs is a classifier."""
        if len(self.head.labels) != 1:
            raise bad_request(f"{path} needs a model with one output (a cross-encoder, a reward head or a yes/no "
                              f"reranker); this one has {len(self.head.labels)}: use /classify.", param="model")

    def check(self, path: str, prompts: list[list[int]], param: str) -> list[list[int]]:
        check_fan_out(len(prompts), 1, self.limits)
        for ids in prompts:
            max_new_tokens_for(ids, 1, param, self.limits)  # non-empty, in the vocabulary, fits the context
        return prompts

    def _text(self, text: str, param: str, special: bool = True) -> list[int]:
        check_prompt_text(text, self.limits, param=param)
        return self.tokenizer.encode(text) if special else self.tokenizer.encode_plain(text)

    # ---- LightLLM -----------------------------------------------------------------------------------

    def _parse_get_score(self, body: bytes) -> list[list[int]]:
        req = decode_body(body, GetScoreRequest)
        if req.multimodal_params:
            raise bad_request("multimodal_params: only text is scored.", param="multimodal_params")
        if isinstance(req.chat, str):  # LightLLM sends the templated text as is
            return self.check("/get_score", [self._text(req.chat, "chat", special=False)], "chat")
        if not req.chat or not self.tokenizer.has_chat_template:
            raise bad_request("`chat` must be text, or messages for a tokenizer with a chat template.", param="chat")
        if any(m.tool_calls for m in req.chat):
            raise bad_request("chat: tool_calls are not scored.", param="chat")
        messages = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(req.chat)]
        check_prompt_text("".join(m["content"] for m in messages), self.limits, param="chat")
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=False)
        except Exception as e:  # the template may reject an order of roles
            raise bad_request(f"The chat template rejected the messages: {e}", param="chat") from None
        return self.check("/get_score", [ids], "chat")

    def needs_head(self, path: str) -> None:
        if self.head is None:
            raise _no_head(path, self.task)

    async def get_score(self, body: bytes) -> Response:
        self.needs_head("/get_score")
        prompts = await asyncio.to_thread(self._parse_get_score, body)
        scores = (await self.scores("/get_score", prompts))[0]
        return json_response({"score": scores[0] if len(scores) == 1 else scores, "prompt_tokens": len(prompts[0]),
                              "finish_reason": "stop"})

    # ---- vLLM ---------------------------------------------------------------------------------------

    def _parse_classify(self, body: bytes) -> tuple[ClassifyRequest, list[list[int]]]:
        req = decode_body(body, ClassifyRequest)
        check_model(req.model, self.limits)
        x = input_prompts(req.input)
        prompts = [self._text(p, "input", req.add_special_tokens) if isinstance(p, str) else list(p) for p in x]
        return req, self.check("/classify", prompts, "input")

    async def classify(self, body: bytes) -> Response:
        self.needs_head("/classify")
        req, prompts = await asyncio.to_thread(self._parse_classify, body)
        scores = await self.scores("/classify", prompts)
        data = []
        for i, s in enumerate(scores):
            probs = class_probs(s)
            data.append({"index": i, "label": self.head.labels[max(range(len(probs)), key=probs.__getitem__)],
                         "probs": probs, "num_classes": len(probs)})
        return json_response(self._envelope("classify", data, prompts))

    def _parse_score(self, body: bytes) -> list[list[int]]:
        req = decode_body(body, ScoreRequest)
        check_model(req.model, self.limits)
        self.one_output("/v1/score")
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not first or not second:
            raise bad_request("`text_1` and `text_2` must not be empty.", param="text_1")
        if len(first) == 1:
            first = first * len(second)  # one query against every document, as vLLM pairs them
        if len(first) != len(second):
            raise bad_request(f"`text_1` has {len(first)} texts and `text_2` {len(second)}: give one text_1, or as "
                              "many as text_2.", param="text_1")
        for a, b in zip(first, second):
            check_prompt_text(a + b, self.limits, param="text_2")
        return self.check("/v1/score", [self.pair_prompt(a, b) for a, b in zip(first, second)], "text_2")

    async def score(self, body: bytes) -> Response:
        self.needs_head("/v1/score")
        prompts = await asyncio.to_thread(self._parse_score, body)
        scores = await self.scores("/v1/score", prompts)
        data = [{"index": i, "object": "score", "score": class_probs(s)[0]} for i, s in enumerate(scores)]
        return json_response(self._envelope("score", data, prompts))

    def _envelope(self, kind: str, data: list[dict], prompts: list[list[int]]) -> dict:
        tokens = sum(len(p) for p in prompts)
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.limits.served_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}
