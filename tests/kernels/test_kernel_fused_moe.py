"""The fused MoE layer (kernels/fused_moe.py) against kernels/reference.py: routing (softmax, top-k, renormalized
or not), the pairs sorted by expert and padded to the block, and the two grouped GEMMs with the SiLU-mul and the
routing weight fused. Under the interpreter at small awkward shapes (widths no block divides, 1 to 13 experts,
top-1 to top-3, experts that get no token, expert-parallel halves); on a GPU at Qwen3-30B-A3B's, Qwen1.5-MoE's
and Mixtral-8x7B's expert shapes in bf16, inside a CUDA graph too; and the default launches built for sm90."""
import contextlib

import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference, settings
from llaunch.kernels.settings import KernelSettings, MoeLaunch


def experts(num: int, hidden: int, inter: int, dtype, device="cpu"):
    """w13 [E, 2I, H], w2 [E, H, I] scaled so every product is O(1)."""
    w13 = torch.randn(num, 2 * inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(num, hidden, inter, device=device) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def routed(tokens: int, num: int, top_k: int, device="cpu", only=None):
    """Routing of random logits: (weights float32, ids int32); `only`: every token among these experts."""
    logits = torch.randn(tokens, num, device=device)
    if only is not None:
        logits[:, [e for e in range(num) if e not in only]] = -30.0
    return reference.moe_route(logits, top_k, renormalize=True)


@pytest.mark.parametrize("tokens, num, top_k", [(1, 4, 1), (5, 8, 2), (37, 13, 3), (64, 60, 4), (3, 128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_interpreted(ops, poisoned, tokens, num, top_k, renormalize):
    logits = torch.randn(tokens, num) * 3
    with poisoned():
        weights, ids = ops.moe_route(logits, top_k, renormalize)
    want_weights, want_ids = reference.moe_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("tokens, start, local", [(23, 0, 8), (23, 0, 3), (23, 5, 3), (23, 2, 1),  # one expert a rank
                                                  (700, 0, 8), (700, 3, 4)])  # 1,400 pairs: two placing programs
def test_align_sorts_pairs_by_expert_in_padded_runs(poisoned, block_m, tokens, start, local):
    from llaunch.kernels.fused_moe import align

    ids = torch.randint(0, 8, (tokens, 2), dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 7, (tokens,))) % 8  # two different experts per token
    ids[ids == 6] = 2  # expert 6 gets no token
    with poisoned():  # every slot written: pairs, or the padding value
        sorted_pairs, block_expert, padded = align(ids, local, start, block_m)
    flat, pairs, used = ids.reshape(-1), ids.numel(), int(padded)
    assert used % block_m == 0 and used <= sorted_pairs.numel() - 1
    seen = []
    for b in range(used // block_m):
        run = sorted_pairs[b * block_m:(b + 1) * block_m].tolist()
        real = [p for p in run if p < pairs]
        assert real == run[:len(real)] and all(p == pairs for p in run[len(real):])  # padding after the pairs
        assert all(flat[p] - start == block_expert[b] for p in real)
        seen += real
    local_pairs = [p for p in range(pairs) if start <= flat[p] < start + local]
    assert sorted(seen) == local_pairs  # every local pair once, no other
    assert all(p == pairs for p in sorted_pairs[used:-1].tolist())
    counts = [int(((flat - start) == e).sum()) for e in range(local)]
    assert used == sum(-(-c // block_m) * block_m for c in counts)  # runs padded to the block, empty ones skipped


SHAPES = [  # tokens, experts, top-k, hidden, intermediate
    (1, 8, 2, 48, 40),  # one decode token: six experts idle
    (5, 4, 1, 64, 24),
    (37, 13, 3, 40, 56),
    (17, 6, 3, 96, 20),
]


@pytest.mark.parametrize("tokens, num, top_k, hidden, inter", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: on the GPU (the interpreter truncates to it)
def test_fused_moe_interpreted(ops, poisoned, close, tokens, num, top_k, hidden, inter, dtype):
    x = torch.randn(tokens, hidden).to(dtype)
    w13, w2 = experts(num, hidden, inter, dtype)
    weights, ids = routed(tokens, num, top_k)
    with poisoned():
        out = ops.fused_moe(x, w13, w2, weights, ids)
    close(out, reference.fused_moe(x, w13, w2, weights, ids))


def test_experts_without_tokens_and_a_crowded_one(ops, poisoned, close):
    """Every token routed among experts 1 and 4 of 7: five get nothing, two get more than a block."""
    x = torch.randn(40, 32)
    w13, w2 = experts(7, 32, 24, torch.float32)
    weights, ids = routed(40, 7, 2, only=(1, 4))
    assert set(ids.unique().tolist()) == {1, 4}
    with poisoned():
        out = ops.fused_moe(x, w13, w2, weights, ids)
    close(out, reference.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens, num, top_k, hidden, inter", SHAPES)
@pytest.mark.parametrize("launch", ["1/16/32/4/1/1", "1/8/16/1/1/1", "16/32/32/4/1/1"])
def test_pair_gemvs_and_grouped_gemms_alike(ops, poisoned, close, launch, tokens, num, top_k, hidden, inter):
    """Either kind of launch (BLOCK_M 1: each pair's GEMVs, unsorted; else sorted runs of grouped GEMMs) at any
    step size: the reference's output, whole and as the shares of expert-parallel ranks."""
    x = torch.randn(tokens, hidden)
    w13, w2 = experts(num, hidden, inter, torch.float32)
    weights, ids = routed(tokens, num, top_k)
    half = num // 2
    text = ",".join(f"{e}x{inter}x{hidden}={launch}" for e in {num, half, num - half})
    before = settings.configure(KernelSettings(moe_shapes=text))
    try:
        with poisoned():
            close(ops.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))
        for start, stop in ((0, half), (half, num)):
            share = ops.fused_moe(x, w13[start:stop].contiguous(), w2[start:stop].contiguous(), weights, ids, start)
            close(share, reference.fused_moe(x, w13[start:stop], w2[start:stop], weights, ids, start))
    finally:
        settings.configure(before)


@pytest.mark.parametrize("tokens, num, top_k, hidden, inter", SHAPES)
def test_expert_parallel_shares_sum_to_the_whole(ops, close, tokens, num, top_k, hidden, inter):
    """Each rank's whole experts (parallel.ep): its share is the reference's for those experts, pairs of the
    other rank's experts add zero, and the shares sum to the layer."""
    x = torch.randn(tokens, hidden)
    w13, w2 = experts(num, hidden, inter, torch.float32)
    weights, ids = routed(tokens, num, top_k)
    half = num // 2
    shares = []
    for start, stop in ((0, half), (half, num)):
        share = ops.fused_moe(x, w13[start:stop].contiguous(), w2[start:stop].contiguous(), weights, ids, start)
        close(share, reference.fused_moe(x, w13[start:stop], w2[start:stop], weights, ids, start))
        shares.append(share)
    close(shares[0] + shares[1], reference.fused_moe(x, w13, w2, weights, ids))


def test_moe_shapes_setting_picks_the_launch(ops, close):
    """kernels.moe_shapes: the smallest token bound that holds, then the unbounded entry; wider tiles still agree."""
    from llaunch.kernels.fused_moe import default_launch, launch_for

    text = "4x24x64@8=16/16/16/1/1,4x24x64=32/64/32/4/2/2,4x24x64@2=64/32/64/2/1/1"
    before = settings.configure(KernelSettings(moe_shapes=text))
    try:
        assert launch_for(2, 4, 24, 64) == MoeLaunch(64, 32, 64, 2, 1, 1)
        assert launch_for(8, 4, 24, 64) == MoeLaunch(16, 16, 16, 1, 1)
        assert launch_for(9, 4, 24, 64) == MoeLaunch(32, 64, 32, 4, 2, 2)
        assert launch_for(9, 4, 24, 48) == default_launch(9, 4)
        x = torch.randn(9, 64)
        w13, w2 = experts(4, 64, 24, torch.float32)
        weights, ids = routed(9, 4, 2)
        close(ops.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))
    finally:
        settings.configure(before)


def test_launches_measured_on_a_gpu_model_apply_where_moe_shapes_is_silent():
    """kernels/moe_launches.py's table: a listed GPU model's launches for a listed layer shape; any other GPU or
    shape the default; kernels.moe_shapes naming the shape wins over the table."""
    from llaunch.kernels.fused_moe import default_launch, launch_for
    from llaunch.kernels.moe_launches import MOE_SHAPES_BY_DEVICE
    from llaunch.kernels.settings import parse_moe_shapes

    measured = parse_moe_shapes(MOE_SHAPES_BY_DEVICE["NVIDIA H200"])[(128, 768, 2048)]
    (first_bound, first), (_, unbounded) = measured[0], measured[-1]
    assert launch_for(1, 128, 768, 2048, 8, "NVIDIA H200") == first
    assert launch_for(first_bound + 1, 128, 768, 2048, 8, "NVIDIA H200") == measured[1][1]
    assert launch_for(100_000, 128, 768, 2048, 8, "NVIDIA H200") == unbounded
    assert launch_for(1, 128, 768, 2048, 8, "NVIDIA A100-SXM4-80GB") == default_launch(1, 128, 8)
    assert launch_for(1, 60, 1408, 2048, 4, "NVIDIA H200") == default_launch(1, 60, 4)
    before = settings.configure(KernelSettings(moe_shapes="128x768x2048=16/64/64/4/3/1"))
    try:
        assert launch_for(1, 128, 768, 2048, 8, "NVIDIA H200") == MoeLaunch(16, 64, 64, 4, 3, 1)
    finally:
        settings.configure(before)


@pytest.mark.parametrize("text", ["4x24=16/16/16/1/1", "4x24x64=16/16/16/1", "4x24x64=8/16/16/1/1",
                                  "4x24x64=16/24/16/1/1", "4x24x64@0=16/16/16/1/1", "4x24x64=16/16/16/32/1"])
def test_bad_moe_shapes_are_named(text):
    [(key, message)] = KernelSettings(moe_shapes=text).problems()
    assert key == "kernels.moe_shapes" and repr(text) in message


def test_the_ops_take_the_reference_on_cpu():
    x = torch.randn(3, 32)
    w13, w2 = experts(4, 32, 16, torch.float32)
    logits = torch.randn(3, 4)
    weights, ids = ops.moe_route(logits, 2, True)
    assert torch.equal(ids, reference.moe_route(logits, 2, True)[1])
    assert torch.equal(ops.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))


# ---- GPU: the experts of Qwen3-30B-A3B (tp1, tp4), Qwen1.5-MoE-A2.7B and Mixtral-8x7B (tp8) --------------------

GPU_SHAPES = [(128, 8, 2048, 768), (128, 8, 2048, 192), (60, 4, 2048, 1408), (8, 2, 4096, 1792)]


@pytest.mark.gpu
@pytest.mark.parametrize("num, top_k, hidden, inter", GPU_SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 16, 333, 2048])  # 1, 2: the pairs' GEMVs (top-8)
def test_fused_moe_gpu(cuda, poisoned, close, num, top_k, hidden, inter, tokens):
    x = torch.randn(tokens, hidden, device=cuda).to(torch.bfloat16)
    w13, w2 = experts(num, hidden, inter, torch.bfloat16, cuda)
    weights, ids = routed(tokens, num, top_k, cuda)
    with poisoned():
        out = ops.fused_moe(x, w13, w2, weights, ids)
    close(out, reference.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("num, top_k", [(128, 8), (60, 4), (8, 2)])
def test_route_gpu(cuda, num, top_k):
    """Each token gets k distinct experts with their softmax probabilities as weights, the reference's k largest;
    bf16 router logits tie exactly in ~1% of 4096 tokens, and there the two may take either of the tied experts
    (and order them either way): a differing choice must be an exact tie with the k-th logit."""
    logits = (torch.randn(4096, num, device=cuda) * 2).to(torch.bfloat16)
    weights, ids = ops.moe_route(logits, top_k, renormalize=False)
    want_weights, want_ids = reference.moe_route(logits, top_k, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids.long()), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sort(dim=-1).values, want_weights.sort(dim=-1).values, atol=1e-6, rtol=1e-5)
    chosen = torch.zeros(logits.shape, dtype=torch.bool, device=cuda).scatter_(1, ids.long(), True)
    wanted = torch.zeros_like(chosen).scatter_(1, want_ids.long(), True)
    assert (chosen.sum(dim=-1) == top_k).all()
    kth = logits.float().topk(top_k, dim=-1).values[:, -1:].expand(-1, num)
    differ = chosen ^ wanted
    assert (logits.float()[differ] == kth[differ]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 24])  # the pairs' GEMVs, the sorted grouped GEMMs
@pytest.mark.parametrize("with_pdl", [False, True])  # captured as the decode graphs are: the MoE kernels with PDL
def test_fused_moe_replays_in_a_cuda_graph(cuda, close, tokens, with_pdl):
    """Routing, sorting and both GEMMs capture (no host sync) and replay on new inputs as run eagerly, also with
    programmatic dependent launch (each kernel waits for the one before it: a missing wait reads stale ids)."""
    from llaunch.kernels import pdl

    num, top_k, hidden, inter = 128, 8, 2048, 192
    w13, w2 = experts(num, hidden, inter, torch.bfloat16, cuda)
    gate = (torch.randn(num, hidden, device=cuda) / hidden ** 0.5).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device=cuda).to(torch.bfloat16)

    def layer(h):
        weights, ids = ops.moe_route(ops.linear(h, gate), top_k, True)
        return ops.fused_moe(h, w13, w2, weights, ids)

    layer(x)  # compile outside the capture
    with pdl.for_graphs() if with_pdl else contextlib.nullcontext():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
    for seed in range(3):
        x.copy_(torch.randn(tokens, hidden, device=cuda, generator=torch.Generator(cuda).manual_seed(seed)))
        graph.replay()
        close(out, layer(x))


# ---- sm90 builds of the default launches (no GPU needed) ----------------------------------------------------------

_COMPILE = r'''
import importlib, inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
moe = importlib.import_module("llaunch.kernels.fused_moe")
out = {}
for name, fn in (("gate_up", moe._gate_up_kernel), ("down", moe._down_kernel)):
    for tokens in (16, 4096):  # the least step of top-8 pairs the grouped GEMMs take by default, a large one
        launch = moe.default_launch(tokens, 128, 8)
        constexprs = dict(UPCAST=False, PRECISION="tf32", BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                          BLOCK_K=launch.block_k, GROUP_M=launch.group_m)
        if name == "gate_up":
            constexprs["TOP_K"] = 8
        sig = {}
        for p in inspect.signature(fn.fn).parameters:
            if p in constexprs:
                sig[p] = "constexpr"
            elif p in ("sorted_ptr", "block_expert_ptr"):
                sig[p] = "*i32"
            elif p in ("padded_ptr",):
                sig[p] = "*i64"
            elif p in ("weights_ptr",):
                sig[p] = "*fp32"
            elif p.endswith("_ptr"):
                sig[p] = "*bf16"
            else:
                sig[p] = "i32"
        # what a launch at the real shapes specializes on: 16-byte aligned pointers, widths and strides divisible
        # by 16 (without it the loads are not pipelined: one stage's shared memory)
        names = list(sig)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n][0] == "*" or n in ("N", "K") or n.startswith("stride_")}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": launch.warps, "num_stages": launch.stages})
        out[f"{name} tokens={tokens}"] = {"shared": kernel.metadata.shared, "stages": launch.stages,
                                          "async copies": kernel.asm["ttgir"].count("async_copy_global_to_local")}
print(json.dumps(out))
'''


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_default_launches_build_for_sm90_pipelined_within_shared_memory(sm90_compile):
    from tests.kernels.test_sm90_builds import SHARED_LIMIT

    builds = sm90_compile(_COMPILE)
    assert len(builds) == 4
    for name, build in builds.items():
        assert build["shared"] <= SHARED_LIMIT, (name, build)
        assert build["async copies"] >= build["stages"] - 1, (name, build)  # loads run ahead of the dots
