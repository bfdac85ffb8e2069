"""Embedding models (model.task=embed) over real HTTP with the official openai client: tiny random Qwen3 and Qwen2
base models saved by transformers as sentence-transformers folders (modules.json, 1_Pooling/config.json, a
Normalize module or not). Every embedding is compared with transformers' own final hidden states, pooled (last
token, mean) and normalized as the folder says, at cosine >= 0.999; long prompts run in several prefill chunks,
and the prompt cache holds earlier prompts' prefixes while they are asked again."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from fixtures.tiny_models import FAMILY_DIMS, TINY_DIMS, TOKENIZER_FILES, tokenizer_dir
from integration.conftest import start_server

COSINE = 0.999
TEXTS = ["The quick brown fox", "Paris is the capital of France.", "1 2 3 4 5 6 7 8 9 10 11 12"]
# longer than router.chunked_prefill_size below: pooled over three chunks
LONG = " ".join(f"word{i}" for i in range(30)) + " and the end of a long prompt."
CHUNK = 16


def write_embedder(path: Path, family: str, pooling: str, normalize: bool, seed: int, **config) -> Path:
    """transformers' base model (Qwen3Model / Qwen2Model: no LM head, saved without a `model.` prefix) with SmolLM2's
    tokenizer, as a sentence-transformers folder: modules.json (Transformer, Pooling[, Normalize]) and
    1_Pooling/config.json as sentence-transformers writes them."""
    import transformers

    name = {"qwen3": "Qwen3", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, f"{name}Config")(**{**TINY_DIMS, **FAMILY_DIMS[family]}, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}Model")(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir() / f).is_file():
            shutil.copy(tokenizer_dir() / f, path / f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir()
    modes = {"cls_token": pooling == "cls", "mean_tokens": pooling == "mean", "max_tokens": False,
             "mean_sqrt_len_tokens": False, "weightedmean_tokens": False, "lasttoken": pooling == "last"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": cfg.hidden_size, **{f"pooling_mode_{k}": v for k, v in modes.items()},
         "include_prompt": True}, indent=2))
    return path


class Oracle:
    """transformers' AutoModel on the folder: last_hidden_state (after the final norm), pooled, normalized."""

    def __init__(self, path: Path, pooling: str, normalize: bool):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.pooling, self.normalize = pooling, normalize

    @torch.no_grad()
    def embed(self, ids: list[int], dimensions: int | None = None) -> np.ndarray:
        hidden = self.model(torch.tensor([ids])).last_hidden_state[0]
        v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[self.pooling][:dimensions]
        if self.normalize:
            v = torch.nn.functional.normalize(v, p=2, dim=0)
        return v.numpy()

    def text(self, text: str, dimensions: int | None = None) -> np.ndarray:
        return self.embed(self.tokenizer(text)["input_ids"], dimensions)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def last_token(tmp_path_factory):
    """Qwen3-Embedding's shape: last-token pooling, normalized, Matryoshka-trained (config.json says so)."""
    path = write_embedder(tmp_path_factory.mktemp("qwen3-embed"), "qwen3", "last", True, seed=5,
                          is_matryoshka=True)
    with start_server(tmp_path_factory, "qwen3-embed",
                      ["model=auto", f"model.path={path}", f"router.chunked_prefill_size={CHUNK}"]) as server:
        yield server, Oracle(path, "last", True)


@pytest.fixture(scope="module")
def mean(tmp_path_factory):
    """Mean pooling, no Normalize module: the raw mean of the final hidden states; two tensor-parallel ranks, each
    adding up its chunks' (replicated) final norm outputs."""
    path = write_embedder(tmp_path_factory.mktemp("qwen2-mean"), "qwen2", "mean", False, seed=6)
    with start_server(tmp_path_factory, "qwen2-mean", ["model=auto", f"model.path={path}", "parallel=tp2",
                                                        f"router.chunked_prefill_size={CHUNK}"]) as server:
        yield server, Oracle(path, "mean", False)


def served_name(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def check(got, want, normalized: bool) -> None:
    assert len(got) == len(want)
    assert cosine(got, want) >= COSINE
    if normalized:
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
    else:  # the raw pooled state: its length is the model's too
        assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=1e-3)


@pytest.mark.parametrize("fixture", ["last_token", "mean"])
def test_openai_client_embeddings_equal_transformers(fixture, request):
    server, oracle = request.getfixturevalue(fixture)
    c, name, normalized = client(server), served_name(server), oracle.normalize
    # one text; the client asks for base64 unless told (float32 little-endian, decoded by the client)
    one = c.embeddings.create(model=name, input=TEXTS[0])
    assert [d.index for d in one.data] == [0] and one.model == name
    check(one.data[0].embedding, oracle.text(TEXTS[0]), normalized)
    assert one.usage.prompt_tokens == len(oracle.tokenizer(TEXTS[0])["input_ids"]) == one.usage.total_tokens

    # a batch, as floats, with a prompt of three chunks; the same texts again read the prompt cache's prefixes
    texts = TEXTS + [LONG]
    assert len(oracle.tokenizer(LONG)["input_ids"]) > 2 * CHUNK
    for _ in range(2):
        batch = c.embeddings.create(model=name, input=texts, encoding_format="float")
        assert [d.index for d in batch.data] == list(range(len(texts)))
        for d, text in zip(batch.data, texts):
            check(d.embedding, oracle.text(text), normalized)
        assert batch.usage.prompt_tokens == sum(len(oracle.tokenizer(t)["input_ids"]) for t in texts)
    # a prompt that continues a cached one: the cache lends its prefix (last) or nothing (mean)
    longer = LONG + " More words follow here."
    check(c.embeddings.create(model=name, input=longer).data[0].embedding, oracle.text(longer), normalized)

    # token ids: one prompt as floats, and a list of prompts asked for in base64 (the client leaves that string
    # to the caller when the caller asks for it)
    ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    [d] = c.embeddings.create(model=name, input=ids[0], encoding_format="float").data
    check(d.embedding, oracle.embed(ids[0]), normalized)
    for d, p in zip(c.embeddings.create(model=name, input=ids, encoding_format="base64").data, ids):
        check(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"), oracle.embed(p), normalized)


def test_matryoshka_dimensions(last_token, mean):
    server, oracle = last_token
    r = client(server).embeddings.create(model=served_name(server), input=TEXTS, dimensions=16)
    for d, text in zip(r.data, TEXTS):
        assert len(d.embedding) == 16
        check(d.embedding, oracle.text(text, dimensions=16), True)  # truncated, then normalized
    server, _ = mean
    with pytest.raises(openai.BadRequestError) as e:
        client(server).embeddings.create(model=served_name(server), input="hi", dimensions=16)
    assert "Matryoshka" in str(e.value) and e.value.body["param"] == "dimensions"


def test_an_embedding_model_refuses_generation_and_scores(last_token):
    server, _ = last_token
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "embedding_model" and "model.task=embed" in r.text
    r = httpx.post(server.url + "/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "model.task=embed" in r.json()["error"]["message"]
