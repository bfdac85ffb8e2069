"""POST /v1/rerank, /rerank and /v2/rerank in Cohere's and Jina's shape (as vLLM serves them): a query and
documents (strings or {text}), each pair scored by the score model (runtime/http/score_api.py: a cross-encoder's
pair encoding, or a yes/no reranker's documented prompt), the head's one output through a sigmoid as the
relevance_score; results sorted by it, best first, with each document's index, cut to top_n."""
from __future__ import annotations

import asyncio
import uuid
from typing import Optional, Union

import msgspec
from quart import Response

from llaunch.runtime.web.errors import bad_request, json_response
from llaunch.runtime.http.openai_protocol import check_model
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.request_limits import check_prompt_text
from llaunch.runtime.http.score_api import ScoreApi, class_probs

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


class RerankDocument(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    query: str
    documents: list[Union[str, RerankDocument]]
    model: Optional[str] = None
    top_n: Optional[int] = None  # the best this many; None: every document
    return_documents: bool = True  # each result carries its document ({text}), as vLLM and Jina answer by default
    instruction: Optional[str] = None  # a yes/no reranker's <Instruct> (its card's default when unset)
    user: Optional[str] = None


def _text(doc: Union[str, RerankDocument]) -> str:
    return doc if isinstance(doc, str) else doc.text


class RerankApi:
    def __init__(self, scoring: ScoreApi):
        self.scoring = scoring

    def _parse(self, path: str, body: bytes) -> tuple[RerankRequest, list[list[int]]]:
        scoring = self.scoring
        req = decode_body(body, RerankRequest)
        check_model(req.model, scoring.limits)
        scoring.one_output(path)
        if not req.documents:
            raise bad_request("`documents` must not be empty.", param="documents")
        if req.top_n is not None and req.top_n < 1:
            raise bad_request(f"`top_n` must be at least 1, got {req.top_n}.", param="top_n")
        if req.instruction is not None and not scoring.head.yes_no:
            raise bad_request("`instruction` is a yes/no reranker's (model.score_head=yes_no); a cross-encoder reads "
                              "the query and document alone.", param="instruction")
        for doc in req.documents:
            check_prompt_text(req.query + _text(doc), scoring.limits, param="documents")
        prompts = [scoring.pair_prompt(req.query, _text(doc), req.instruction) for doc in req.documents]
        return req, scoring.check(path, prompts, "documents")

    async def rerank(self, path: str, body: bytes) -> Response:
        self.scoring.needs_head(path)
        req, prompts = await asyncio.to_thread(self._parse, path, body)
        scores = await self.scoring.scores(path, prompts)
        relevance = [class_probs(s)[0] for s in scores]
        order = sorted(range(len(relevance)), key=lambda i: -relevance[i])[:req.top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": relevance[i]}
            if req.return_documents:
                result["document"] = {"text": _text(req.documents[i])}
            results.append(result)
        tokens = sum(len(p) for p in prompts)
        return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": self.scoring.limits.served_name,
                              "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
