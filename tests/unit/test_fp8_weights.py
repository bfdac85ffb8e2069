"""fp8 weights against transformers on the same weights dequantized, greedy token for token (float32,
CPU): fp8 checkpoints as published (compressed-tensors, fbgemm_fp8, fp8; per-channel, per-tensor and
128x128 block-wise scales; dynamic per-token (per token per block), static and no activation
quantization) for Qwen2 and Llama, tp1 and tp2 (gloo), and model.quantization=fp8 quantizing a float
checkpoint at load.

The oracle rounds each linear's input to e4m3 as the fp8 GEMM does (fixtures/fp8_checkpoints.py).
tp2 runs the static, weight-only and block-wise schemes: dynamic per-token scales of a row-parallel
layer are each rank's (its slice of the input, as vLLM's), so per-token tp2 rounds differently from
tp1 by design, while a block-wise layer's groups of 128 columns lie whole on one rank and round as at
tp1. The block-wise models are wider (hidden 320, heads of 64, intermediate 512): blocks of 128 are
partial at the edges (320 = 2.5 blocks), Qwen2's q‖k‖v starts each part on a block (scales per block
of rows) where Llama's k and v of 64 rows do not, nor do Qwen2's at tp2 (scales per row)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fixtures.forward_batches import SlotTables, head_gaps
from fixtures.forward_batches import greedy as llaunch_greedy
from fixtures.fp8_checkpoints import BLOCK, WIDE, hf_greedy, oracle_model, write_fp8_checkpoint
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.kernels.fp8 import FP8
from llaunch.runtime.config import WeightQuantization
from llaunch.runtime.models.fp8_linear import Fp8Layer
from llaunch.runtime.models.loader import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_NEW = 12
PROMPTS = [list(range(100, 111)), [5, 907, 31000, 42, 42, 42, 7, 1234, 8800], [49000, 3, 17]]
CALIBRATION = list(range(1000, 1064))
# (name, float model, style, weight scale strategy, activations, tp)
CASES = [
    ("qwen2-ct-channel-dynamic", "qwen2", "compressed-tensors", "channel", "dynamic", 1),
    ("llama-fbgemm-channel-dynamic", "llama", "fbgemm_fp8", "channel", "dynamic", 1),
    ("llama-fp8-tensor-static", "llama", "fp8", "tensor", "static", 2),
    ("qwen2-ct-channel-weightonly", "qwen2", "compressed-tensors", "channel", "none", 2),
    ("qwen2-fp8-block-dynamic", "qwen2-wide", "fp8", "block", "dynamic", 2),
    ("llama-ct-block-dynamic", "llama-wide", "compressed-tensors", "block", "dynamic", 2),
]
# (rows, columns) each block-wise case's fused q‖k‖v holds a scale for at tp1
QKV_BLOCKS = {"qwen2-fp8-block-dynamic": BLOCK, "llama-ct-block-dynamic": (1, BLOCK[1])}


def rank_main(rank: int, cfgs: dict, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for name, cfg in cfgs.items():
            model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, tp_rank=rank, tp_size=2)
            tokens = [llaunch_greedy(model, p, MAX_NEW) for p in PROMPTS]
            if rank == 0:
                torch.save(tokens, Path(out_dir) / f"{name}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    floats = {f: write_tiny_checkpoint(root / f"float-{f}", f.removesuffix("-wide"), seed=3,
                                       **(WIDE if f.endswith("-wide") else {}))
              for f in ("qwen2", "llama", "qwen2-wide", "llama-wide")}
    made = {}
    for name, family, style, strategy, activations, tp in CASES:
        scales = write_fp8_checkpoint(floats[family], root / name, root / f"{name}-oracle", style, strategy,
                                      activations, CALIBRATION)
        group = BLOCK[1] if strategy == "block" else 0
        made[name] = (root / name, oracle_model(root / f"{name}-oracle", activations, scales, group))
    tp2 = {name: model_config_from_folder(made[name][0]) for name, *_, tp in CASES if tp == 2}
    mp.spawn(rank_main, args=(tp2, str(root / "rendezvous"), str(root)), nprocs=2, join=True)
    return root, floats, made


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_checkpoint_greedy_equals_transformers_dequantized(checkpoints, case):
    root, _, made = checkpoints
    name, *_, tp = case
    folder, oracle = made[name]
    expected = [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    model = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Layer)]
    assert len(fp8_layers) == 4 * model.arch.num_hidden_layers and all(m.qweight.dtype == FP8 for m in fp8_layers)
    if name in QKV_BLOCKS:
        assert {m.block for m in fp8_layers if m.scale_parts()[0][0].endswith("q_proj")} == {QKV_BLOCKS[name]}
    assert [llaunch_greedy(model, p, MAX_NEW) for p in PROMPTS] == expected
    # and the logits: ~1e-7 apart, where rounding activations differently (or not at all) moves every
    # position ~2e-2. Not every position: an input within float32's noise of halfway between two e4m3
    # values (one in ~10^4-10^5) rounds the other way in one of the two, moving that position and those
    # after it that attend to it by ~1e-3 (llama-ct-block-dynamic has one at position 2)
    tables = SlotTables(model, max_rows=1, max_len=64)
    got = model.forward(tables.batch(prefill=[(0, PROMPTS[1])], all_logits=True), tables.kv)
    with torch.inference_mode():
        want = oracle(torch.tensor([PROMPTS[1]])).logits[0]
    apart = (got - want).abs().amax(dim=-1) / max(1.0, want.abs().max().item())
    assert (apart <= 1e-5).float().mean().item() >= 0.75 and apart.max().item() <= 2e-2, apart
    if tp == 2:
        assert torch.load(root / f"{name}.pt") == expected


def test_quantization_fp8_quantizes_a_float_checkpoint_at_load(checkpoints):
    _, floats, made = checkpoints
    # the compressed-tensors per-channel dynamic case is exactly what quantizing at load does
    folder, oracle = made["qwen2-ct-channel-dynamic"]
    cfg = replace(model_config_from_folder(floats["qwen2"]), quantization=WeightQuantization.fp8)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    assert sum(isinstance(m, Fp8Layer) for m in model.modules()) == 4 * model.arch.num_hidden_layers
    got = [llaunch_greedy(model, p, MAX_NEW) for p in PROMPTS]
    assert got == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    plain = build_model(model_config_from_folder(floats["qwen2"]), device=torch.device("cpu"), dtype=torch.float32)
    assert not any(isinstance(m, Fp8Layer) for m in plain.modules())


def quantized_at_load_oracle(folder: Path, head: bool):
    """transformers on `folder`'s weights as model.quantization=fp8 quantizes them at load (per channel, dequantized),
    each linear's input rounded to e4m3 per token; with `head` the LM head's too (a new weight: a tied embedding keeps
    its float copy, as llaunch's does)."""
    from transformers import AutoModelForCausalLM

    from fixtures.fp8_checkpoints import LINEAR, round_to_fp8
    from llaunch.kernels.fp8 import quantize_weight

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if LINEAR.fullmatch(f"{name}.weight") or (head and name == "lm_head"):
                q, scale = quantize_weight(m.weight)
                m.weight = torch.nn.Parameter(q.float() * scale[:, None], requires_grad=False)
                m.register_forward_pre_hook(lambda m, a: (round_to_fp8(
                    a[0], (a[0].abs().amax(dim=-1, keepdim=True) / 448).clamp(min=1.0 / (448 * 512))),))
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # Qwen2's own LM head, Llama's tied to the embedding
def test_fp8_lm_head_quantizes_the_head_per_vocabulary_row(checkpoints, family):
    _, floats, _ = checkpoints
    cfg = replace(model_config_from_folder(floats[family]), quantization=WeightQuantization.fp8, fp8_lm_head=True)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    head = model.lm_head
    assert head.qweight.dtype == FP8 and head.weight is None and head.weight_scale.shape == (head.vocab_size,)
    assert model.embed_tokens.weight.dtype == torch.float32  # the lookup keeps its float rows
    oracle, plain_fp8 = (quantized_at_load_oracle(floats[family], head=h) for h in (True, False))
    assert [llaunch_greedy(model, p, MAX_NEW) for p in PROMPTS] == [hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
    # the logits are the quantized head's: ~1e-7 from its oracle, where the float head's are ~1e-2 away
    ours, float_head = head_gaps(model, oracle, plain_fp8, PROMPTS[1])
    assert ours <= 1e-5 and float_head >= 1e-3


@pytest.mark.parametrize("tp, rank, qkv, gate_up", [
    (1, 0, (128, 128), (128, 128)), (2, 1, (128, 128), (128, 128)), (4, 3, (128, 128), (128, 128)),
    (8, 5, (128, 128), (1, 128)),  # 18,944 / 8 = 2,368 rows of gate and of up a rank: 18.5 blocks
])
def test_block_scales_are_held_per_block_where_the_split_allows_else_per_row(tp, rank, qkv, gate_up):
    """Qwen2-7B's layers as a block-wise checkpoint fills them (built on the meta device: shapes only):
    q‖k‖v's parts are whole heads of 128 rows at every tp, gate‖up's only up to tp4; at tp8 down_proj's
    ranks would start mid-block, which the layer refuses (and the launcher before it)."""
    from gpu.conftest import profile_shape
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLayer
    from llaunch.runtime.models.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.quant_scheme import WeightQuant

    arch = ModelArch.from_hf_config(profile_shape("qwen2-7b"))
    layer = DecoderLayer(arch, 0, TpGroup(rank, tp), torch.device("meta"), torch.bfloat16)
    quant = WeightQuant("fp8", block=BLOCK)
    fused = {name: Fp8ColumnParallelLinear(base, quant) for name, base in
             (("qkv", layer.self_attn.qkv_proj), ("gate_up", layer.mlp.gate_up_proj))}
    assert (fused["qkv"].block, fused["gate_up"].block) == (qkv, gate_up)
    rows = fused["gate_up"].weight_scale.shape[0]
    assert rows == (2 * 18944 // tp if gate_up[0] == 1 else 2 * 18944 // tp // 128)
    assert fused["gate_up"].block_rows()[rows // 2] == ("model.layers.0.mlp.up_proj", rank * 18944 // tp // 128)
    o_proj = Fp8RowParallelLinear(layer.self_attn.o_proj, quant)
    assert o_proj.weight_scale.shape == (28, len(o_proj.block_columns()))
    if tp == 8:
        with pytest.raises(ValueError, match="cut the checkpoint's blocks of 128 columns"):
            Fp8RowParallelLinear(layer.mlp.down_proj, quant)
    else:
        assert Fp8RowParallelLinear(layer.mlp.down_proj, quant).block_columns()[0] == rank * 148 // tp
