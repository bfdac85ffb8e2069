"""model.quantization=int8 against transformers with the same int8 rows dequantized as its decoder linears (float32,
CPU): greedy token for token on Qwen2 (q/k/v bias, an odd head count), Llama (tied, one KV head), Gemma 3 (GeGLU, q/k
norms, local layers) and Phi-3 (q/k/v and gate/up fused in the checkpoint), at tp1, and at tp2 (gloo: a row-parallel
layer's rank rounds its block of each row's columns with a scale of its own); the logits the int8 layers' own, no
float copy of a weight left (the memory plan's count: test_quant_rules)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from fixtures.forward_batches import greedy, head_gaps
from fixtures.fp8_checkpoints import hf_greedy
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.kernels import int8
from llaunch.runtime.config import WeightQuantization
from llaunch.runtime.models.int8_linear import Int8Layer
from llaunch.runtime.models.loader import build_model
from unit.test_fp8_weights import MAX_NEW, PROMPTS, rank_main  # rank_main: each rank's greedy tokens of PROMPTS

FAMILIES = [("qwen2", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=16)), ("llama", {}),
            ("gemma3_text", {}), ("phi3", {})]
ROW_PARALLEL = ("o_proj", "down_proj")


def int8_oracle(folder, quantized: bool = True, tp: int = 1):
    """transformers on `folder`; `quantized`: every decoder linear's weight replaced by its int8 rows dequantized, a
    row-parallel layer's (o_proj, down_proj) in `tp` blocks of columns rounded apart, as its ranks round them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if quantized:
        with torch.no_grad():
            for name, layer in model.model.named_modules():
                if isinstance(layer, torch.nn.Linear):
                    blocks = layer.weight.chunk(tp if name.endswith(ROW_PARALLEL) else 1, dim=1)
                    w = torch.cat([int8.dequantized(int8.quantize_rows(b), torch.float32) for b in blocks], dim=1)
                    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return model


@pytest.mark.parametrize("family, shape", FAMILIES)
def test_int8_linears_serve_the_int8_rows_token_for_token(tmp_path, family, shape):
    folder = write_tiny_checkpoint(tmp_path / family, family, seed=7, **shape)
    cfg = replace(model_config_from_folder(folder), quantization=WeightQuantization.int8)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, Int8Layer)]
    assert len(layers) == 4 * len(model.layers)  # q‖k‖v, o_proj, gate‖up, down_proj: every one
    assert all(m.qweight.dtype == torch.int8 and m.weight_scale.shape == (m.qweight.shape[0],) for m in layers)
    oracle, plain = int8_oracle(folder), int8_oracle(folder, quantized=False)
    assert [greedy(model, p, MAX_NEW) for p in PROMPTS] == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    # the logits are the int8 layers': ~1e-6 from their oracle, where the float model's are further
    ours, float_model = head_gaps(model, oracle, plain, PROMPTS[1])
    assert ours <= 1e-4 and float_model >= 10 * ours


def test_quantizing_frees_every_float_weight(tmp_path):
    """The float weights go when their layers are swapped: an int8 layer keeps no reference to its float one (whose
    memory would otherwise stay allocated and shrink the KV cache the memory plan sized)."""
    import gc
    import weakref

    from llaunch.runtime.models.fp8_linear import float_linears
    from llaunch.runtime.models.int8_linear import quantize_linears_int8

    folder = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    model = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    floats = [weakref.ref(layer.weight) for _, _, layer in float_linears(model)]
    assert len(floats) == 4 * len(model.layers)
    quantize_linears_int8(model)
    gc.collect()
    assert [f() for f in floats] == [None] * len(floats)


@pytest.mark.slow
def test_int8_linears_at_tp2_are_the_oracles_token_for_token(tmp_path):
    shapes = {"qwen2": {}, "llama": {}}  # even head counts: each rank holds half of o_proj's columns
    folders = {f: write_tiny_checkpoint(tmp_path / f, f, seed=7, **shape) for f, shape in shapes.items()}
    cfgs = {f: replace(model_config_from_folder(folder), quantization=WeightQuantization.int8)
            for f, folder in folders.items()}
    mp.spawn(rank_main, args=(cfgs, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    for family, folder in folders.items():
        oracle = int8_oracle(folder, tp=2)
        assert torch.load(tmp_path / f"{family}.pt") == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS], family
