"""fp8 weights against transformers on the same weights dequantized, greedy token for token (float32,
CPU): fp8 checkpoints as published (compressed-tensors, fbgemm_fp8, fp8; per-channel and per-tensor
scales; dynamic per-token, static and no activation quantization) for Qwen2 and Llama, tp1 and tp2
(gloo), and model.quantization=fp8 quantizing a float checkpoint at load.

The oracle rounds each linear's input to e4m3 as the fp8 GEMM does (fixtures/fp8_checkpoints.py).
tp2 runs the static and weight-only schemes: dynamic per-token scales of a row-parallel layer are
each rank's (its slice of the input, as vLLM's), so dynamic tp2 rounds differently from tp1 by design."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fixtures.forward_batches import SlotTables
from fixtures.fp8_checkpoints import hf_greedy, oracle_model, write_fp8_checkpoint
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.kernels.fp8 import FP8
from llaunch.runtime.config import WeightQuantization
from llaunch.runtime.models.fp8_linear import Fp8Layer
from llaunch.runtime.models.loader import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_NEW = 12
PROMPTS = [list(range(100, 111)), [5, 907, 31000, 42, 42, 42, 7, 1234, 8800], [49000, 3, 17]]
CALIBRATION = list(range(1000, 1064))
# (name, family, style, weight scale strategy, activations, tp)
CASES = [
    ("qwen2-ct-channel-dynamic", "qwen2", "compressed-tensors", "channel", "dynamic", 1),
    ("llama-fbgemm-channel-dynamic", "llama", "fbgemm_fp8", "channel", "dynamic", 1),
    ("llama-fp8-tensor-static", "llama", "fp8", "tensor", "static", 2),
    ("qwen2-ct-channel-weightonly", "qwen2", "compressed-tensors", "channel", "none", 2),
]


def llaunch_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    tables = SlotTables(model, max_rows=1, max_len=64)
    out = [int(model.forward(tables.batch(prefill=[(0, prompt)]), tables.kv)[-1].argmax())]
    while len(out) < max_new:
        out.append(int(model.forward(tables.batch(decode=[(0, out[-1])]), tables.kv)[-1].argmax()))
    return out


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
    floats = {f: write_tiny_checkpoint(root / f"float-{f}", f, seed=3) for f in ("qwen2", "llama")}
    made = {}
    for name, family, style, strategy, activations, tp in CASES:
        scales = write_fp8_checkpoint(floats[family], root / name, root / f"{name}-oracle", style, strategy,
                                      activations, CALIBRATION)
        made[name] = (root / name, oracle_model(root / f"{name}-oracle", activations, scales))
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
    assert [llaunch_greedy(model, p, MAX_NEW) for p in PROMPTS] == expected
    # and the logits: ~1e-7 apart, where rounding activations differently (or not at all) moves them ~2e-2
    tables = SlotTables(model, max_rows=1, max_len=64)
    got = model.forward(tables.batch(prefill=[(0, PROMPTS[1])], all_logits=True), tables.kv)
    with torch.inference_mode():
        want = oracle(torch.tensor([PROMPTS[1]])).logits[0]
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
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
