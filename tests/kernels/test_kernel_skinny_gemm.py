"""The skinny GEMM (kernels/skinny_gemm.py): linear layers of 2-16 rows on the tensor cores, plain, with bias and
gated gate‖up, K split or whole, against the torch references they replace; through dispatch where
kernels.skinny_rows takes them; rows independent of each other; replayed in a CUDA graph with PDL."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference

# Interpreter launch shapes (BLOCK_N, BLOCK_K, WARPS, STAGES, SPLIT): whole K; K in 3 shares (uneven, some empty)
SHAPES = {"whole": (16, 64, 4, 1, 1), "split": (16, 32, 4, 2, 3)}


@pytest.fixture(params=list(SHAPES))
def launch(request, monkeypatch):
    from llaunch.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "INTERPRETED_SHAPE", SHAPES[request.param])
    return request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("n, k", [(37, 300), (64, 256), (129, 72)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_interpreted(ops, poisoned, close, launch, dtype, rows, n, k, bias):
    from llaunch.kernels import split_k

    x = torch.randn(rows, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    with poisoned():
        out = ops.skinny_gemm(x, w, b)
    close(out, reference.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype))
    assert not split_k.counters(x.device, 9).any()  # the last program of each tile reset its counter


@pytest.mark.parametrize("rows", [2, 7])
@pytest.mark.parametrize("inner, k", [(45, 264), (16, 32)])
def test_gated_skinny_gemm_interpreted(ops, poisoned, close, rows, inner, k, monkeypatch):
    from llaunch.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "INTERPRETED_SHAPE", SHAPES["whole"])
    x = torch.randn(rows, k).half()
    w = (2 * torch.randn(2 * inner, k) / k ** 0.5).half()
    with poisoned():
        out = ops.skinny_gemm(x, w, gated=True)
    # gate and up summed in float32 and rounded to the dtype, then SiLU-and-multiply there (the unfused roundings)
    close(out, reference.silu_mul(reference.linear(x.float(), w.float()).half()))


def test_skinny_gemm_refuses_what_it_cannot_run(ops, monkeypatch):
    from llaunch.kernels import skinny_gemm

    w = torch.randn(8, 32).half()
    with pytest.raises(ValueError, match="1 to 16 rows"):
        ops.skinny_gemm(torch.randn(17, 32).half(), w)
    with pytest.raises(ValueError, match="even row count"):
        ops.skinny_gemm(torch.randn(2, 32).half(), torch.randn(7, 32).half(), gated=True)
    with pytest.raises(ValueError, match="columns"):
        ops.skinny_gemm(torch.randn(2, 16).half(), w)
    with pytest.raises(ValueError, match="without bias"):
        ops.skinny_gemm(torch.randn(2, 32).half(), w, torch.randn(4).half(), gated=True)
    monkeypatch.setattr(skinny_gemm.settings.current, "skinny_shapes", {(4, 32, True): (16, 16, 4, 1, 2)})  # a split
    with pytest.raises(ValueError, match="ungated"):
        ops.skinny_gemm(torch.randn(2, 32).half(), torch.randn(8, 32).half(), gated=True)


def test_kernels_skinny_rows_says_which_products_it_takes(kernel_settings):
    """2..16 rows by default; with kernels.skinny_rows=R the 16-bit products of 2..R rows, nothing else; 0: none."""
    from llaunch.kernels import skinny_gemm

    w = torch.randn(8, 32).half()
    assert skinny_gemm.takes(torch.randn(16, 32).half(), w) and not skinny_gemm.takes(torch.randn(17, 32).half(), w)
    kernel_settings(skinny_rows=0)
    assert not skinny_gemm.takes(torch.randn(4, 32).half(), w)
    kernel_settings(skinny_rows=8)
    assert skinny_gemm.takes(torch.randn(2, 32).half(), w) and skinny_gemm.takes(torch.randn(8, 32).half(), w)
    assert not skinny_gemm.takes(torch.randn(1, 32).half(), w)  # one row: the GEMV
    assert not skinny_gemm.takes(torch.randn(9, 32).half(), w)
    assert not skinny_gemm.takes(torch.randn(4, 32), w.float())  # float32: cuBLAS
    assert not skinny_gemm.takes(torch.randn(4, 32).half(), w.bfloat16())


def test_launch_shapes_split_narrow_layers_only(kernel_settings, monkeypatch):
    """Built in (the GPU's): K split while the programs stay within TARGET_PROGRAMS, never for gate‖up; 16-row
    tiles for a layer that would have few programs; kernels.skinny_shapes overrides a shape."""
    from llaunch.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "_INTERPRETED", False)
    assert skinny_gemm.launch_shape(3584, 18944, False) == (64, 128, 4, 4, 4)  # Qwen2-7B's down_proj: 56 tiles
    assert skinny_gemm.launch_shape(4608, 3584, False) == (64, 128, 4, 4, 2)  # qkv: 72 tiles
    assert skinny_gemm.launch_shape(18944, 3584, True) == (32, 128, 4, 4, 1)  # gate‖up: 592 tiles
    assert skinny_gemm.launch_shape(152064, 3584, False)[4] == 1  # an LM head
    # SmolLM2's (576 wide): 16-row tiles, where 64-row ones would make 9-48 programs
    assert skinny_gemm.launch_shape(960, 576, False) == (16, 128, 4, 4, 1)  # q‖k‖v: 60 tiles
    assert skinny_gemm.launch_shape(576, 1536, False) == (16, 128, 4, 4, 2)  # down_proj: 36 tiles, 72 programs
    assert skinny_gemm.launch_shape(1536, 576, True) == (16, 128, 4, 4, 1)  # gate‖up: 96 tiles
    assert skinny_gemm.launch_shape(49152, 576, False) == (64, 128, 4, 4, 1)  # its LM head: 768 tiles
    kernel_settings(skinny_shapes="3584x18944=32/256/8/3/8")
    assert skinny_gemm.launch_shape(3584, 18944, False) == (32, 256, 8, 3, 8)


@pytest.mark.parametrize("text", ["3584x18944=32/256/8", "3584x18944:gated=32/128/4/4/2", "5x5=8/64/4/4",
                                  "5x5=32/64/4/0", "5x5:fp8=32/64/4/4"])
def test_bad_skinny_shapes_are_refused(text):
    from llaunch.kernels.settings import KernelSettings

    assert [key for key, _ in KernelSettings(skinny_shapes=text).problems()] == ["kernels.skinny_shapes"]
    assert [key for key, _ in KernelSettings(skinny_rows=17).problems()] == ["kernels.skinny_rows"]


# Qwen2-7B's q‖k‖v (bias), o_proj, down_proj, gate‖up (gated), LM head, SmolLM2's (16-row tiles) q‖k‖v, down_proj
# (K split) and gate‖up, and an odd small one
GPU_SHAPES = [(4608, 3584, True, False), (3584, 3584, False, False), (3584, 18944, False, False),
              (37888, 3584, False, True), (152064, 3584, False, False), (960, 576, False, False),
              (576, 1536, False, False), (3072, 576, False, True), (37, 100, True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("n, k, bias, gated", GPU_SHAPES, ids=[f"{n}x{k}{':gated' if g else ''}" for n, k, _, g in GPU_SHAPES])
def test_skinny_gemm_gpu(cuda, poisoned, close, kernel_settings, rows, n, k, bias, gated):
    """bf16 through dispatch with kernels.skinny_rows=16 and the shape in kernels.skinny_one_row (the op the decoder
    calls) against the float32 product rounded once to bf16, as the kernel rounds; each row alone gives the same
    bits (rows do not mix)."""
    kernel_settings(skinny_rows=16, skinny_one_row=[f"{n // 2}x{k}:gated" if gated else f"{n}x{k}"])  # gated: N = I
    x = torch.randn(rows, k, device=cuda).to(torch.bfloat16)
    w = (torch.randn(n, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, device=cuda).to(torch.bfloat16) if bias else None
    with poisoned():
        out = ops.gated_linear(x, w) if gated else ops.linear(x, w, b)
    want = reference.linear(x.float(), w.float(), None if b is None else b.float())
    want = reference.silu_mul(want.to(torch.bfloat16)) if gated else want.to(torch.bfloat16)
    close(out, want)
    from llaunch.kernels.dispatch import triton_ops

    alone = torch.cat([triton_ops().skinny_gemm(x[i:i + 1], w, b, gated=gated) for i in range(rows)])
    assert torch.equal(out, alone)


@pytest.mark.gpu
@pytest.mark.parametrize("with_pdl", [False, True])
def test_split_skinny_gemm_replays_in_a_cuda_graph(cuda, close, captured, kernel_settings, with_pdl):
    """Qwen2-7B's down_proj (K split) then gate‖up, 5 rows as a verify step launches them, chained in a captured
    graph (with PDL: each launch waits for the previous one before touching the split counters)."""
    kernel_settings(skinny_rows=16)
    down = (torch.randn(3584, 18944, device=cuda) / 18944 ** 0.5).to(torch.bfloat16)
    gate_up = (torch.randn(37888, 3584, device=cuda) / 3584 ** 0.5).to(torch.bfloat16)
    x = torch.randn(5, 18944, device=cuda).to(torch.bfloat16)

    def chain():
        return ops.gated_linear(ops.linear(x, down), gate_up)

    graph, out = captured(chain, with_pdl)
    for seed in range(3):
        x.copy_(torch.randn(5, 18944, device=cuda, generator=torch.Generator(cuda).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, chain())  # the sum order is fixed: replayed = eager, bit for bit
        mid = reference.linear(x.float(), down.float()).to(torch.bfloat16)
        close(ops.linear(x, down), mid)


def test_kernels_skinny_one_row_takes_the_named_shapes_from_the_gemv(ops, kernel_settings, monkeypatch):
    """kernels.skinny_one_row: a named weight shape's one-row products (batch-1 decode) run the skinny GEMM, gated or
    not, as it computes them for more rows; other shapes, float32 rows and float32 logits stay on the GEMV."""
    from llaunch.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "INTERPRETED_SHAPE", SHAPES["split"])
    w, gate_up = (torch.randn(37, 300) / 300 ** 0.5).half(), (torch.randn(2 * 45, 264) / 264 ** 0.5).half()
    x, xg = torch.randn(1, 300).half(), torch.randn(1, 264).half()
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    kernel_settings(skinny_one_row=["37x300", "45x264:gated"])
    assert torch.equal(ops.gemv(x, w), real(x, w)) and torch.equal(ops.gemv(xg, gate_up, gated=True),
                                                                    real(xg, gate_up, gated=True))
    assert len(calls) == 2
    ops.gemv(torch.randn(1, 300), w.float())  # float32: the GEMV
    ops.gemv(x, w, out_dtype=torch.float32)  # float32 logits: the GEMV
    ops.gemv(torch.randn(1, 264).half(), (torch.randn(45, 264)).half())  # not named
    assert len(calls) == 2
    from llaunch.kernels.settings import KernelSettings

    for bad in (["37x300:fp8"], ["37x"], [37]):
        assert [key for key, _ in KernelSettings(skinny_one_row=bad).problems()] == ["kernels.skinny_one_row"], bad
