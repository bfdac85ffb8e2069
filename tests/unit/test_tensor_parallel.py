"""Tensor parallelism: two gloo processes running tp2 give the logits of tp1 (float32, CPU) on
mixed prefill/decode batches, for tiny Qwen2 (2 KV heads, untied, vocab not divisible by 2), tiny
Llama (1 KV head: replicated on both ranks; tied embeddings), tiny Qwen3 (q/k norms, head_dim 24 in a
width of 64, one KV head per rank), tiny Mistral (5 query heads over 1 KV head: padded to 6), and the MoE
families with each expert's columns split over the ranks (Qwen3-MoE, Qwen2-MoE with its shared expert and a dense
layer, Mixtral), or whole experts on each (`-ep`: parallel.ep=2); Gemma 2 (5 heads over 1 KV head: padded to 6;
soft-caps, a window in its local layers), Gemma 3 (3 heads padded to 4, q/k norms, local rotary) and Phi-3 (6 heads
over 2 KV heads split from the fused qkv_proj, gate_up_proj split per rank, partial LongRoPE)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.models.loader import build_model

TP = 2
MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
VARIANTS = ("gemma2", "gemma3_text", "phi3")


def run_steps(model) -> list[torch.Tensor]:
    """Prefill A; decode A while B prefills in two chunks; decode both."""
    tokens = torch.randint(0, model.arch.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = tokens[:11], tokens[11:30]
    tables = SlotTables(model)
    steps = [
        tables.batch(prefill=[(0, a)], all_logits=True),
        tables.batch(decode=[(0, tokens[30])], prefill=[(2, b[:7])], all_logits=True),
        tables.batch(decode=[(0, tokens[31])], prefill=[(2, b[7:])], all_logits=True),
        tables.batch(decode=[(0, tokens[32]), (2, tokens[33])]),
        tables.batch(decode=[(2, tokens[34]), (0, tokens[35])]),
    ]
    return [model.forward(batch, tables.kv) for batch in steps]


def rank_main(rank: int, cfgs: dict, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        for name, cfg in cfgs.items():
            model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, tp_rank=rank, tp_size=TP,
                                expert_parallel=name.endswith("-ep"))
            torch.save(run_steps(model), Path(out_dir) / f"{name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    cfgs = {
        "qwen2": model_config_from_folder(write_tiny_checkpoint(root / "qwen2", "qwen2", vocab_size=49155)),
        "llama": model_config_from_folder(write_tiny_checkpoint(root / "llama", "llama")),
        "qwen3": model_config_from_folder(write_tiny_checkpoint(root / "qwen3", "qwen3")),
        "mistral": model_config_from_folder(write_tiny_checkpoint(root / "mistral", "mistral")),
        **{name: model_config_from_folder(write_tiny_checkpoint(root / name, name)) for name in (*MOE, *VARIANTS)},
    }
    cfgs.update({f"{name}-ep": cfgs[name] for name in MOE})
    mp.spawn(rank_main, args=(cfgs, str(root / "rendezvous"), str(root)), nprocs=TP, join=True)
    return root, cfgs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "mistral", *MOE, *(f"{n}-ep" for n in MOE), *VARIANTS])
def test_tp2_logits_equal_tp1(tp_runs, name):
    root, cfgs = tp_runs
    single = run_steps(build_model(cfgs[name], device=torch.device("cpu"), dtype=torch.float32))
    ranks = [torch.load(root / f"{name}.rank{r}.pt") for r in range(TP)]
    for step, ref in enumerate(single):
        for r in range(TP):
            got = ranks[r][step]
            assert got.shape == ref.shape == (got.shape[0], cfgs[name].vocab_size)
            # the all-reduce sums partial products in another order: float32 rounding only
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"step {step} rank {r}: {diff:.3g}"
