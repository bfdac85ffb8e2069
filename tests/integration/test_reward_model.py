"""Score models (model.task=score, LightLLM's use_reward_model): tiny random Qwen2 / Llama
*ForSequenceClassification checkpoints served on CPU; /get_score, /classify and /v1/score over real
HTTP equal transformers' logits (fp32), and generation routes are refused with a 400."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from fixtures.tiny_models import FAMILY_DIMS, TINY_DIMS, TOKENIZER_FILES, tokenizer_dir
from integration.conftest import start_server

ATOL = 1e-4
TEXTS = ["The quick brown fox", "Paris is the capital of", "1 2 3 4 5 6 7 8 9 10 11 12"]
CHAT = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes, on a clear day."}]
LABELS = ["negative", "neutral", "positive"]


def write_classifier(path: Path, family: str, num_labels: int, seed: int) -> Path:
    """A random `family` *ForSequenceClassification checkpoint (transformers' save_pretrained) with
    SmolLM2's tokenizer; the score head is scaled up so its outputs differ by more than noise."""
    from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen2Config,
                              Qwen2ForSequenceClassification)

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
                             "llama": (LlamaConfig, LlamaForSequenceClassification)}[family]
    labels = {} if num_labels == 1 else {"id2label": dict(enumerate(LABELS)),
                                         "label2id": {n: i for i, n in enumerate(LABELS)}}
    config = config_cls(**{**TINY_DIMS, **FAMILY_DIMS[family]}, num_labels=num_labels, **labels)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        model.score.weight.mul_(50)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, path / name)
    return path


class Oracle:
    """transformers' *ForSequenceClassification on the same folder: logits of one prompt at a time."""

    def __init__(self, path: Path):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> list[float]:
        return self.model(torch.tensor([ids])).logits[0].tolist()

    def text(self, text: str) -> list[float]:
        return self.logits(self.tokenizer.encode(text))

    def chat(self, messages: list[dict]) -> list[float]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return self.logits(self.tokenizer.encode(text, add_special_tokens=False))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def softmax(xs: list[float]) -> list[float]:
    return torch.softmax(torch.tensor(xs, dtype=torch.float64), -1).tolist()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    """Qwen2ForSequenceClassification, one output: a reward head."""
    path = write_classifier(tmp_path_factory.mktemp("qwen2-reward"), "qwen2", 1, seed=1)
    with start_server(tmp_path_factory, "qwen2-reward", ["model=qwen2", f"model.path={path}"]) as server:
        yield server, Oracle(path)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """LlamaForSequenceClassification, three labelled outputs."""
    path = write_classifier(tmp_path_factory.mktemp("llama-cls"), "llama", 3, seed=2)
    with start_server(tmp_path_factory, "llama-cls", ["model=llama", f"model.path={path}"]) as server:
        yield server, Oracle(path)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_reward_scores_equal_transformers(reward):
    server, oracle = reward
    text = oracle.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    r = post(server, "/get_score", {"chat": text})  # LightLLM's client templates the chat itself
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["score"] == pytest.approx(oracle.chat(CHAT)[0], abs=ATOL)
    assert out["prompt_tokens"] == len(oracle.tokenizer.encode(text, add_special_tokens=False))
    r = post(server, "/get_score", {"chat": CHAT})  # messages: the server applies the template
    assert r.json()["score"] == pytest.approx(oracle.chat(CHAT)[0], abs=ATOL)

    # a batch; the token-id prompt ends in pad tokens, which transformers does not pool
    pad = oracle.model.config.pad_token_id
    padded = oracle.tokenizer.encode("A padded prompt") + [pad, pad]
    r = post(server, "/classify", {"model": server_name(server), "input": TEXTS})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["num_classes"] == 1 for d in data)
    for d, text in zip(data, TEXTS):
        assert d["probs"][0] == pytest.approx(sigmoid(oracle.text(text)[0]), abs=ATOL)
        assert d["label"] == "LABEL_0"
    [d] = post(server, "/classify", {"input": padded}).json()["data"]
    assert d["probs"][0] == pytest.approx(sigmoid(oracle.logits(padded)[0]), abs=ATOL)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(oracle.tokenizer.encode(t)) for t in TEXTS)

    # vLLM's /v1/score: one text_1 against each text_2, joined by the tokenizer's pair template
    r = post(server, "/v1/score", {"text_1": "What is the capital of France?", "text_2": ["Paris.", "Berlin."]})
    assert r.status_code == 200, r.text
    for d, second in zip(r.json()["data"], ["Paris.", "Berlin."]):
        ids = oracle.tokenizer("What is the capital of France?", text_pair=second)["input_ids"]
        assert d["object"] == "score" and d["score"] == pytest.approx(sigmoid(oracle.logits(ids)[0]), abs=ATOL)


def server_name(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_a_score_model_refuses_generation(reward):
    server, _ = reward
    assert server_name(server)  # /v1/models still lists it
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": CHAT}),
                       ("/generate", {"inputs": "Hi"})]:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert "score model" in r.json()["error"]["message"] and r.json()["error"]["code"] == "score_model"


def test_classifier_labels_and_logits_equal_transformers(classifier):
    server, oracle = classifier
    r = post(server, "/classify", {"input": TEXTS})
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], TEXTS):
        logits = oracle.text(text)
        assert d["num_classes"] == 3 and d["probs"] == pytest.approx(softmax(logits), abs=ATOL)
        assert d["label"] == LABELS[max(range(3), key=logits.__getitem__)]
    r = post(server, "/get_score", {"chat": CHAT})  # several outputs: the raw logits
    assert r.json()["score"] == pytest.approx(oracle.chat(CHAT), abs=ATOL)
    r = post(server, "/v1/score", {"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]


def write_reward_model(path: Path, seed: int) -> tuple[Path, "torch.nn.Module", "torch.nn.Module"]:
    """A Qwen2ForRewardModel folder as Qwen2.5-Math-RM publishes it (its head is remote code, so the
    file is written by hand): transformers' Qwen2Model weights under `model.` plus `score.0` / `score.2`,
    the Linear + ReLU + Linear head. Returns the folder and the modules, the oracle."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(**{**TINY_DIMS, **FAMILY_DIMS["qwen2"]}, architectures=["Qwen2ForRewardModel"])
    torch.manual_seed(seed)
    body = Qwen2Model(config).float().eval()
    h = config.hidden_size
    head = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 1)).float().eval()
    with torch.no_grad():
        head[2].weight.mul_(20)
        for name, p in body.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    tensors = {f"model.{k}": v.contiguous() for k, v in body.state_dict().items()}
    tensors |= {f"score.{k}": v.contiguous() for k, v in head.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, path / name)
    return path, body, head


def test_qwen2_reward_model_head_under_tp2_equals_its_oracle(tmp_path_factory):
    """Qwen2ForRewardModel (Qwen2.5-Math-RM's MLP head, one reward per sequence, pooled at the last
    token), served with the head replicated over two tensor-parallel ranks."""
    from transformers import AutoTokenizer

    path, body, head = write_reward_model(tmp_path_factory.mktemp("qwen2-rm"), seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)

    @torch.no_grad()
    def reward(ids: list[int]) -> float:
        return head(body(torch.tensor([ids])).last_hidden_state[0, -1]).item()

    with start_server(tmp_path_factory, "qwen2-rm", ["model=qwen2", f"model.path={path}", "parallel=tp2"]) as server:
        r = post(server, "/classify", {"input": TEXTS})
        assert r.status_code == 200, r.text
        for d, text in zip(r.json()["data"], TEXTS):
            assert d["num_classes"] == 1
            assert d["probs"][0] == pytest.approx(sigmoid(reward(tokenizer.encode(text))), abs=ATOL)
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
        r = post(server, "/get_score", {"chat": CHAT})
        assert r.status_code == 200, r.text
        assert r.json()["score"] == pytest.approx(reward(tokenizer.encode(text, add_special_tokens=False)), abs=ATOL)
