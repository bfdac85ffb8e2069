"""model.int8_lm_head against transformers with the same int8 rows dequantized as its LM head (float32, CPU): greedy
token for token on Qwen2 (its own head, odd head count) and Llama (tied to the embedding), at tp1 and tp2 (gloo: each
rank quantizes its block of the vocabulary's rows), the logits the head's own, and the memory plan (the rule against model.fp8_lm_head beside it: tests/unit/test_rules.py's BREAKS)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from fixtures.forward_batches import greedy, head_gaps
from fixtures.fp8_checkpoints import hf_greedy
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.kernels import int8
from llaunch.runtime.models.loader import build_model
from unit.test_rules import free_port, resolved  # noqa: F401 (fixtures)

MAX_NEW = 12
PROMPTS = [list(range(100, 111)), [5, 907, 31000, 42, 42, 42, 7, 1234, 8800], [49000, 3, 17]]
FAMILIES = [("qwen2", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=16)), ("llama", {})]


def int8_head_oracle(folder, head: bool):
    """transformers on `folder`; with `head` its LM head's weight replaced by the int8 rows dequantized (a new weight:
    a tied embedding keeps its float rows for the lookup, as llaunch's does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if head:
        with torch.no_grad():
            rows = int8.quantize_rows(model.lm_head.weight)
            model.lm_head.weight = torch.nn.Parameter(int8.dequantized(rows, torch.float32), requires_grad=False)
    return model


@pytest.mark.parametrize("family, shape", FAMILIES)
def test_int8_lm_head_serves_the_int8_rows_token_for_token(tmp_path, family, shape):
    folder = write_tiny_checkpoint(tmp_path / family, family, seed=5, **shape)
    cfg = replace(model_config_from_folder(folder), int8_lm_head=True)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    head = model.lm_head
    assert head.qweight.dtype == torch.int8 and head.weight is None and head.weight_scale.shape == (head.vocab_size,)
    assert model.embed_tokens.weight.dtype == torch.float32  # the lookup keeps its float rows
    # each row's absmax is ±127 times its scale (an all-zero row, Llama's padding embedding: zeros)
    amax = head.qweight.abs().amax(dim=1)
    assert ((amax == 127) | (amax == 0)).all() and (amax == 127).float().mean() > 0.99
    oracle, plain = int8_head_oracle(folder, True), int8_head_oracle(folder, False)
    assert [greedy(model, p, MAX_NEW) for p in PROMPTS] == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    # the logits are the int8 head's: ~1e-7 from its oracle, where the float head's are further
    ours, float_head = head_gaps(model, oracle, plain, PROMPTS[1])
    assert ours <= 1e-5 and float_head >= 1e-4


def test_rows_round_to_nearest_with_their_absmax_at_127():
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-3.0, 1.0, 0.0104]])
    rows = int8.quantize_rows(w)
    assert rows.weight.tolist() == [[0, 0, 0], [127, -64, 32], [-127, 42, 0]]  # 63.5 → 64 and 31.75 → 32: nearest
    assert rows.scale.tolist() == pytest.approx([1.0, 1 / 127, 3 / 127])
    assert (int8.dequantized(rows, torch.float32) - w).abs().max() <= 3 / 127 / 2 + 1e-7


@pytest.mark.slow
def test_int8_lm_head_at_tp2_is_the_oracles_token_for_token(tmp_path):
    from unit.test_fp8_weights import MAX_NEW as RANK_MAX_NEW, PROMPTS as RANK_PROMPTS, rank_main

    assert (RANK_PROMPTS, RANK_MAX_NEW) == (PROMPTS, MAX_NEW)  # rank_main greedily continues these
    folders = {family: write_tiny_checkpoint(tmp_path / family, family, seed=5, **shape) for family, shape in FAMILIES}
    cfgs = {family: replace(model_config_from_folder(folder), int8_lm_head=True) for family, folder in folders.items()}
    mp.spawn(rank_main, args=(cfgs, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    for family, folder in folders.items():
        oracle = int8_head_oracle(folder, True)
        assert torch.load(tmp_path / f"{family}.pt") == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS], family


@pytest.mark.parametrize("profile", ["qwen2-7b", "smollm2-135m"])
def test_an_int8_head_frees_an_own_head_and_adds_to_a_tied_one(resolved, profile):  # noqa: F811
    from llaunch.launcher import memory_plan
    from llaunch.runtime.models.memory import rank_memory

    base = (f"model={profile}", "model.load_format=dummy", "model.dtype=bfloat16")
    cfg, with_head = resolved(*base), resolved(*base, "model.int8_lm_head=true")
    head = cfg.model.vocab_size * cfg.model.hidden_size
    # Qwen2-7B's own head: 2 bytes a weight become 1; SmolLM2's tied embedding keeps its 2 and the head adds 1
    assert rank_memory(with_head).weights - rank_memory(cfg).weights == (head if cfg.model.tie_word_embeddings
                                                                         else -head)
    assert "(bfloat16 + int8 LM head)" in memory_plan.summary(with_head)
