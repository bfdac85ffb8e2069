"""OpenAI's POST /v1/embeddings on an embedding model (model.task=embed): each input is one prefill whose pooled
final-norm hidden state (runtime/models/pooling.py) comes back as TextDelta.scores; here it is cut to the request's
`dimensions` (a Matryoshka-trained model's), then L2-normalized where the model is (as vLLM does: truncate, then
normalize), and sent as floats or as base64 of little-endian float32 (what the openai client asks for by default)."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass
from typing import Literal, Optional

import msgspec
import numpy as np
from quart import Response

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.web.errors import ApiError, bad_request, json_response
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.openai_protocol import check_model
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import (RequestLimits, check_fan_out, check_prompt_text, max_new_tokens_for)
from llaunch.runtime.http.score_api import Inputs, input_prompts, prefill_outputs

EMBEDDING_PATHS = ("/v1/embeddings",)
NORM_EPS = 1e-12  # torch.nn.functional.normalize's: a zero vector stays zero


@dataclass(frozen=True)
class EmbedModel:
    """What the frontend knows of the served embedding model (the launcher derived it)."""

    hidden_size: int
    normalize: bool
    matryoshka: bool = False
    dimensions: Optional[tuple[int, ...]] = None  # the sizes a request may ask for; None: any up to hidden_size

    @staticmethod
    def of(model: ModelConfig) -> Optional["EmbedModel"]:
        if getattr(model.task, "value", model.task) != "embed":
            return None
        dims = tuple(model.matryoshka_dimensions) if model.matryoshka_dimensions else None
        return EmbedModel(model.hidden_size, bool(model.normalize), bool(model.matryoshka), dims)

    def size(self, dimensions: Optional[int]) -> int:
        """The vector's length for a request's `dimensions`, or a 400 saying why it is not served."""
        if dimensions is None or dimensions == self.hidden_size:
            return self.hidden_size
        if not self.matryoshka:
            raise bad_request(f"`dimensions`: the served model returns {self.hidden_size} values and is not "
                              "Matryoshka-trained (its config.json has no is_matryoshka / matryoshka_dimensions; "
                              "model.matryoshka), so a shorter embedding would be no embedding.", param="dimensions")
        if self.dimensions is not None and dimensions not in self.dimensions:
            raise bad_request(f"`dimensions` must be one of {list(self.dimensions)} (the model's "
                              f"matryoshka_dimensions), got {dimensions}.", param="dimensions")
        if not 1 <= dimensions <= self.hidden_size:
            raise bad_request(f"`dimensions` must be in [1, {self.hidden_size}], got {dimensions}.",
                              param="dimensions")
        return dimensions

    def finish(self, pooled: list[float], size: int) -> np.ndarray:
        v = np.asarray(pooled, dtype=np.float32)[:size]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), NORM_EPS)
        return v


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: Inputs  # a text, texts, token ids, or lists of token ids
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS / EOS around each text


def embed_model_refusal(path: str) -> ApiError:
    return bad_request(f"{path} generates text, but the served model is an embedding model (model.task=embed: it "
                       f"pools hidden states, no LM head); use {', '.join(EMBEDDING_PATHS)}.", code="embedding_model")


class EmbeddingsApi:
    def __init__(self, engine: EngineClient, tokenizer: PromptTokenizer, limits: RequestLimits, lifecycle: Lifecycle,
                 model: Optional[EmbedModel], task: str = "generate"):
        """`task`: the served model's model.task, which the refusal names when `model` is None."""
        self.engine, self.tokenizer, self.limits, self.lifecycle = engine, tokenizer, limits, lifecycle
        self.model, self.task = model, task

    def _parse(self, body: bytes) -> tuple[EmbeddingRequest, list[list[int]], int]:
        req = decode_body(body, EmbeddingRequest)
        check_model(req.model, self.limits)
        size = self.model.size(req.dimensions)
        x = input_prompts(req.input)
        check_fan_out(len(x), 1, self.limits)
        prompts = []
        for p in x:
            if isinstance(p, str):
                check_prompt_text(p, self.limits, param="input")
                p = self.tokenizer.encode(p) if req.add_special_tokens else self.tokenizer.encode_plain(p)
            max_new_tokens_for(list(p), 1, "input", self.limits)  # non-empty, in the vocabulary, fits the context
            prompts.append(list(p))
        return req, prompts, size

    async def create(self, body: bytes) -> Response:
        if self.model is None:
            raise bad_request(f"/v1/embeddings needs an embedding model, but the served model "
                              f"{'generates' if self.task == 'generate' else 'is a ' + self.task + ' model'} "
                              f"(model.task={self.task}); serve one with model.task=embed (a sentence-transformers "
                              "folder picks it with model.task=auto).", code="not_an_embedding_model")
        req, prompts, size = await asyncio.to_thread(self._parse, body)
        pooled = await prefill_outputs(self.engine, self.lifecycle, "/v1/embeddings", prompts)
        data = []
        for i, vec in enumerate(pooled):
            v = self.model.finish(vec, size)
            value = (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if req.encoding_format == "base64"
                     else v.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(p) for p in prompts)
        return json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.limits.served_name, "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
