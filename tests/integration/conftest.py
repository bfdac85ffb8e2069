"""Servers shared by the integration tests: each is a real `llaunch` process graph on a free port."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fixtures.tiny_models import write_tiny_checkpoint
from integration.server import REPO, LlaunchServer

SMOLLM2_DIR = REPO / ".models" / "smollm2-135m"

# Small, fast graphs: a modest KV budget and row count keep start-up and memory low on 2 cores.
CPU_BASE = ["device=cpu", "model.dtype=float32", "cache.max_total_tokens=16384", "router.max_running_requests=64"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for family in ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "gemma3_text",
                   "phi3"):
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        write_tiny_checkpoint(d, family)
        dirs[family] = d
    return dirs


def pytest_collection_modifyitems(items):
    """Every integration test starts real processes: all are `slow`."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


def start_server(tmp_path_factory, name: str, overrides: list[str], base: list[str] = CPU_BASE, **kw) -> LlaunchServer:
    """`base`: CPU_BASE for a serving instance; a pd_master or config server runs no model, and a key it
    does not read is refused (launcher/rules_effect.py): give it ["device=cpu"]."""
    run_dir = tmp_path_factory.mktemp(f"run-{name}")
    return LlaunchServer(base + overrides, run_dir=run_dir, **kw)


@pytest.fixture(scope="module")
def tiny_qwen2_server(tmp_path_factory, tiny_dirs):
    with start_server(tmp_path_factory, "tiny-qwen2",
                      ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", "model.name=tiny-qwen2"]) as server:
        yield server


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    assert SMOLLM2_DIR.joinpath("config.json").exists(), "run `make setup` (scripts/prepare_models.py) first"
    with start_server(tmp_path_factory, "smollm2", []) as server:
        yield server


class HfOracle:
    """transformers on the same weights, float32: the reference for tokens and logprobs."""

    def __init__(self, model_dir: Path):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # pure argmax continuation; callers cut at eos

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new: int) -> list[int]:
        out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                  pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def next_logprobs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def oracles(tiny_dirs):
    cache: dict[str, HfOracle] = {}

    def get(name: str) -> HfOracle:
        if name not in cache:
            cache[name] = HfOracle(SMOLLM2_DIR if name == "smollm2" else tiny_dirs[name])
        return cache[name]

    return get
