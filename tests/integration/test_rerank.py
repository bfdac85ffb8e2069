"""Rerank (POST /v1/rerank, /rerank, /v2/rerank in Cohere's and Jina's shape) over real HTTP: a tiny random
Qwen2ForSequenceClassification cross-encoder, whose relevance scores must be the sigmoid of transformers' own
sequence-classification logits of each (query, document) pair, and a tiny Qwen3 causal LM served as a yes/no
reranker (model.score_head=yes_no), whose scores must be Qwen3-Reranker's documented P(yes) computed with
transformers; in both, results come best first with each document's index."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from fixtures.tiny_models import FAMILY_DIMS, TINY_DIMS, TOKENIZER_FILES, tokenizer_dir
from integration.conftest import start_server
from integration.test_reward_model import Oracle, write_classifier

ATOL = 1e-4  # on probabilities
LOGIT_ATOL = 1e-3  # on the logits behind them (random heads put some probabilities near 0 or 1)
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Berlin is Germany's capital.",
             "The quick brown fox jumps over the lazy dog.", "France's capital: Paris.", "Bananas are yellow."]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def check_ranking(results: list[dict], want: list[float], logits: list[float], top_n: int, documents: bool) -> None:
    """Best first, each with its index and the expected score (`want`, the sigmoid of `logits`)."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:top_n]
    assert [r["index"] for r in results] == order
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=ATOL)
        assert logit(r["relevance_score"]) == pytest.approx(logits[r["index"]], abs=LOGIT_ATOL)
        assert (r.get("document") == {"text": DOCUMENTS[r["index"]]}) if documents else "document" not in r
    assert min(logits[a] - logits[b] for a, b in zip(order, order[1:])) > 10 * LOGIT_ATOL  # the order is decided


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = write_classifier(tmp_path_factory.mktemp("qwen2-ce"), "qwen2", 1, seed=7)
    with start_server(tmp_path_factory, "qwen2-ce", ["model=qwen2", f"model.path={path}"]) as server:
        yield server, Oracle(path)


def test_cohere_rerank_equals_transformers_sequence_classification(cross_encoder):
    server, oracle = cross_encoder
    logits = [oracle.logits(oracle.tokenizer(QUERY, text_pair=d)["input_ids"])[0] for d in DOCUMENTS]
    want = [sigmoid(x) for x in logits]  # vLLM's activation of one output
    # Cohere's request: documents as strings, top_n, return_documents
    r = post(server, "/v1/rerank", {"model": httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
                                    "query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True})
    assert r.status_code == 200, r.text
    out = r.json()
    check_ranking(out["results"], want, logits, 3, documents=True)
    pair_tokens = sum(len(oracle.tokenizer(QUERY, text_pair=d)["input_ids"]) for d in DOCUMENTS)
    assert out["usage"]["total_tokens"] == pair_tokens
    # Jina's: documents as {text}, every result, no documents back; /rerank and /v2/rerank alike
    for path in ("/rerank", "/v2/rerank"):
        r = post(server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                "return_documents": False})
        assert r.status_code == 200, r.text
        check_ranking(r.json()["results"], want, logits, len(DOCUMENTS), documents=False)
    for body, param in [({"query": QUERY, "documents": []}, "documents"),
                        ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
                        ({"query": QUERY, "documents": ["a"], "instruction": "x"}, "instruction")]:
        r = post(server, "/v1/rerank", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def write_yes_no_reranker(path: Path, seed: int) -> Path:
    """A tiny Qwen3ForCausalLM (tied embeddings, as Qwen3-Reranker-0.6B) with SmolLM2's tokenizer; the yes and no
    tokens' rows are scaled so their logits differ by more than noise."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_DIMS, **FAMILY_DIMS["qwen3"]})).float()
    with torch.no_grad():
        for token in ("yes", "no"):
            model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(token)].mul_(60)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, path / name)
    return path


class Qwen3RerankerOracle:
    """Qwen3-Reranker's model-card code, with transformers on the same folder (float32, one pair at a time)."""

    PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.yes, self.no = self.tokenizer.convert_tokens_to_ids("yes"), self.tokenizer.convert_tokens_to_ids("no")

    def prompt(self, query: str, doc: str, instruction: str | None = None) -> list[int]:
        instruction = instruction or "Given a web search query, retrieve relevant passages that answer the query"
        pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        return encode(self.PREFIX) + encode(pair) + encode(self.SUFFIX)

    @torch.no_grad()
    def score(self, query: str, doc: str, instruction: str | None = None) -> tuple[float, float]:
        """(P(yes) as the card computes it, logit(yes) - logit(no))."""
        logits = self.model(torch.tensor([self.prompt(query, doc, instruction)])).logits[:, -1, :]
        pair = torch.stack([logits[:, self.no], logits[:, self.yes]], dim=1)
        p_yes = torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().item()
        return p_yes, (logits[0, self.yes] - logits[0, self.no]).item()


@pytest.fixture(scope="module")
def yes_no(tmp_path_factory):
    path = write_yes_no_reranker(tmp_path_factory.mktemp("qwen3-reranker"), seed=8)
    with start_server(tmp_path_factory, "qwen3-reranker",
                      ["model=auto", f"model.path={path}", "model.score_head=yes_no"]) as server:
        yield server, Qwen3RerankerOracle(path)


def test_yes_no_reranker_equals_its_documented_scores(yes_no):
    server, oracle = yes_no
    want, logits = zip(*(oracle.score(QUERY, d) for d in DOCUMENTS))
    r = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 4})
    assert r.status_code == 200, r.text
    check_ranking(r.json()["results"], want, logits, 4, documents=True)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(oracle.prompt(QUERY, d)) for d in DOCUMENTS)
    # the <Instruct> line a request names; /v1/score pairs go through the same prompt
    instruction = "Judge whether the passage names a capital city"
    want, logits = zip(*(oracle.score(QUERY, d, instruction) for d in DOCUMENTS))
    r = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruction": instruction})
    check_ranking(r.json()["results"], want, logits, len(DOCUMENTS), documents=True)
    r = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:2]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([oracle.score(QUERY, d)[0] for d in DOCUMENTS[:2]],
                                                                   abs=ATOL)
    # a reranker does not generate
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "score_model"
