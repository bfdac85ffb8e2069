"""Programmatic dependent launch (kernels/pdl.py): a decode layer's kernels launched with PDL, as
eager calls and replayed from a CUDA graph, give bit-identical results to the same kernels without
it. A kernel that read its input before the previous kernel finished would see the last replay's
values, so every replay gets new inputs."""
import pytest
import torch

from llaunch.kernels.dispatch import triton_ops

H, QH, KVH, D, INTER = 3584, 28, 4, 128, 18944


def _layer_chain(weights, x, residual, k_cache, v_cache, req_to_slots, positions, slots, seq_lens, cos, sin):
    ops = triton_ops()
    n, h = ops.rmsnorm(x, weights["norm"], 1e-6, residual)
    q, k, v = ops.gemv(n, weights["qkv"], weights["bias"]).split([QH * D, KVH * D, KVH * D], -1)
    q = ops.rotary_store_kv(q.view(1, QH, D), k.view(1, KVH, D), v.view(1, KVH, D), positions, cos, sin,
                            k_cache, v_cache, slots)
    rows = torch.zeros(1, dtype=torch.int64, device=x.device)
    attn = ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, D ** -0.5, max_len=1024)
    o = ops.gemv(attn.view(1, QH * D), weights["o"])
    n, h = ops.rmsnorm(o, weights["norm"], 1e-6, h)
    return ops.gemv(ops.gemv(n, weights["gate_up"], gated=True), weights["down"]), h


# The TMA-staged GEMV (kernels/gemv_staged.py) for every weight shape of the chain: its pipeline
# issues weight tiles before the PDL wait and loads x after it in every iteration.
STAGED = (f"{QH * D + 2 * KVH * D}x{H}=8/256/4/6,{H}x{QH * D}=8/256/4/6,{INTER}x{H}:gated=8/256/4/4,"
          f"{H}x{INTER}=16/256/4/6")


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", ["", STAGED], ids=["built-in GEMV shapes", "staged GEMVs"])
def test_pdl_chain_matches_plain_launches_eager_and_in_a_graph(cuda, kernel_settings, shapes):
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("PDL needs Hopper or later")
    from llaunch.kernels.settings import PDL_KERNELS

    bf = torch.bfloat16
    w = {"norm": torch.rand(H, device=cuda).to(bf) + 0.5, "qkv": (torch.randn(QH * D + 2 * KVH * D, H, device=cuda) / 60).to(bf),
         "bias": torch.randn(QH * D + 2 * KVH * D, device=cuda).to(bf), "o": (torch.randn(H, QH * D, device=cuda) / 60).to(bf),
         "gate_up": (torch.randn(2 * INTER, H, device=cuda) / 60).to(bf), "down": (torch.randn(H, INTER, device=cuda) / 137).to(bf)}
    ctx = 700
    k_cache = torch.randn(1024, KVH, D, device=cuda).to(bf)
    v_cache = torch.randn(1024, KVH, D, device=cuda).to(bf)
    req_to_slots = torch.randperm(1024, device=cuda).to(torch.int32).view(1, 1024)
    cos = torch.randn(2048, D // 2, device=cuda).to(bf)
    sin = torch.randn(2048, D // 2, device=cuda).to(bf)
    static = {"x": torch.empty(1, H, device=cuda, dtype=bf), "r": torch.empty(1, H, device=cuda, dtype=bf)}
    positions = torch.tensor([ctx - 1], device=cuda)
    slots = req_to_slots[0, ctx - 1: ctx].to(torch.int64)
    seq_lens = torch.tensor([ctx], device=cuda, dtype=torch.int32)

    def run():
        return _layer_chain(w, static["x"], static["r"], k_cache, v_cache, req_to_slots, positions, slots, seq_lens,
                            cos, sin)

    inputs = [(torch.randn(1, H, device=cuda).to(bf), torch.randn(1, H, device=cuda).to(bf)) for _ in range(3)]
    expected = []
    kernel_settings(pdl="off", gemv_shapes=shapes, pdl_kernels=list(PDL_KERNELS))  # every kernel that has PDL
    for x, r in inputs:
        static["x"].copy_(x), static["r"].copy_(r)
        expected.append([t.clone() for t in run()])
    kernel_settings(pdl="all", gemv_shapes=shapes, pdl_kernels=list(PDL_KERNELS))
    for (x, r), want in zip(inputs, expected):  # eager, PDL
        static["x"].copy_(x), static["r"].copy_(r)
        for got, exp in zip(run(), want):
            assert torch.equal(got, exp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for (x, r), want in zip(inputs * 2, expected * 2):
        static["x"].copy_(x), static["r"].copy_(r)
        graph.replay()
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp)

