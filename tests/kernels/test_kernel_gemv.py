"""Batch-1 GEMV (plain, with bias, gated gate‖up) vs the references it replaces."""
import pytest
import torch

from llaunch import kernels
from llaunch.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k", [(1, 1), (37, 300), (64, 256), (129, 513)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_interpreted(ops, poisoned, close, dtype, n, k, bias):
    x = torch.randn(1, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    with poisoned():
        out = ops.gemv(x, w, b)
    close(out, reference.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inner, k", [(1, 7), (45, 260), (96, 512)])
def test_gated_gemv_interpreted(ops, poisoned, close, dtype, inner, k):
    x = torch.randn(1, k).to(dtype)
    w = (2 * torch.randn(2 * inner, k) / k ** 0.5).to(dtype)
    with poisoned():
        out = ops.gemv(x, w, gated=True)
    close(out, reference.gated_linear(x, w))


def test_gemv_weight_view(ops, close):
    """A weight with a row stride wider than K (a column slice) is read through its stride."""
    x = torch.randn(1, 200)
    w = torch.randn(50, 260)[:, :200]
    close(ops.gemv(x, w), reference.linear(x, w))


def test_gemv_refuses_several_rows(ops):
    with pytest.raises(ValueError, match="one row"):
        ops.gemv(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, bias", [(4608, 3584, True), (3584, 3584, False), (3584, 18944, False),
                                        (896 + 2 * 128, 896, True), (5, 17, False)])
def test_gemv_gpu(cuda, poisoned, close, n, k, bias):
    """Qwen2-7B's qkv, o_proj and down_proj, a Qwen2-0.5B qkv, and an odd shape, in bf16."""
    x = torch.randn(1, k, device=cuda).to(torch.bfloat16)
    w = (torch.randn(n, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, device=cuda).to(torch.bfloat16) if bias else None
    with poisoned():
        out = kernels.linear(x, w, b)
    close(out, reference.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("inner, k", [(18944, 3584), (4864, 896), (3, 100)])
def test_gated_gemv_gpu(cuda, poisoned, close, inner, k):
    x = torch.randn(1, k, device=cuda).to(torch.bfloat16)
    w = (2 * torch.randn(2 * inner, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    with poisoned():
        out = kernels.gated_linear(x, w)
    close(out, reference.gated_linear(x, w))


def test_gemv_strided_bias(ops, close):
    x, w = torch.randn(1, 40), torch.randn(30, 40)
    b = torch.randn(60)[::2]  # every other element: stride 2
    close(ops.gemv(x, w, b), reference.linear(x, w, b))


def _norm(k, dtype, device="cpu"):
    return (torch.rand(k, device=device) + 0.5).to(dtype), 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, gated, bias", [(37, 300, False, True), (64, 256, False, False), (45, 260, True, False),
                                               (3, 7, True, False)])
def test_gemv_norm_prologue_interpreted_equals_rmsnorm_then_gemv(ops, poisoned, close, dtype, n, k, gated, bias):
    """norm=(weight, eps): the RMSNorm as the GEMV's prologue, with the norm kernel's rounding points:
    bit for bit what rmsnorm → gemv give, and within tolerance of the torch references."""
    x = (3 * torch.randn(1, k)).to(dtype)
    w = (torch.randn(2 * n if gated else n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    norm = _norm(k, dtype)
    with poisoned():
        fused = ops.gemv(x, w, b, gated=gated, norm=norm)
        two = ops.gemv(ops.rmsnorm(x, *norm), w, b, gated=gated)
    assert torch.equal(fused, two)
    normed = reference.rmsnorm(x, *norm)
    close(fused, reference.gated_linear(normed, w) if gated else reference.linear(normed, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_residual_epilogue_interpreted(ops, dtype, gated):
    """residual=r: the output is added to r in place (linear output rounded, then the sum), r returned."""
    n, k = 37, 300
    x = torch.randn(1, k).to(dtype)
    w = (torch.randn(2 * n if gated else n, k) / k ** 0.5).to(dtype)
    r = torch.randn(1, n).to(dtype)
    before = r.clone()
    out = ops.gemv(x, w, gated=gated, residual=r)
    assert out.data_ptr() == r.data_ptr()
    assert torch.equal(r, before + ops.gemv(x, w, gated=gated))


def test_gemv_refuses_a_bad_norm_or_residual(ops):
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="fused RMSNorm: weight \\(7,\\)"):
        ops.gemv(x, w, norm=(torch.ones(7), 1e-6))
    with pytest.raises(ValueError, match="fused RMSNorm: weight \\(8,\\) torch.float16"):
        ops.gemv(x, w, norm=(torch.ones(8).half(), 1e-6))
    with pytest.raises(ValueError, match="residual must be a contiguous \\[1, 4\\]"):
        ops.gemv(x, w, residual=torch.zeros(1, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, gated, bias", [(4608, 3584, False, True), (18944, 3584, True, False),
                                               (1536, 576, True, False)])
def test_gemv_norm_prologue_gpu(cuda, close, n, k, gated, bias):
    """Qwen2-7B's qkv and gate_up and SmolLM2's gate_up in bf16: within tolerance of rmsnorm → gemv
    and of the torch references; prints how many outputs differ from rmsnorm → gemv (the sum of
    squares is summed in another order than the norm kernel's)."""
    x = (3 * torch.randn(1, k, device=cuda)).to(torch.bfloat16)
    w = (torch.randn(2 * n if gated else n, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, device=cuda).to(torch.bfloat16) if bias else None
    norm = _norm(k, torch.bfloat16, cuda)
    ops = kernels.dispatch.triton_ops()
    fused = ops.gemv(x, w, b, gated=gated, norm=norm)
    normed = ops.rmsnorm(x, *norm)
    two = ops.gemv(normed, w, b, gated=gated)
    close(fused, two)
    close(fused, reference.gated_linear(normed, w) if gated else reference.linear(normed, w, b))
    print(f"norm prologue vs rmsnorm → gemv, {n}×{k}: {(fused != two).sum().item()} of {fused.numel()} differ")
    r = torch.randn(1, fused.shape[1], device=cuda).to(torch.bfloat16)
    expected = r + fused
    assert torch.equal(ops.gemv(x, w, b, gated=gated, norm=norm, residual=r), expected)


def test_gemv_refuses_what_the_reference_refuses(ops):
    with pytest.raises(ValueError, match="x is torch.float32, weight torch.float16"):
        ops.gemv(torch.randn(1, 8), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="even row count"):
        ops.gemv(torch.randn(1, 8), torch.randn(5, 8), gated=True)
    with pytest.raises(ValueError, match="x has 8 columns, weight 9"):
        ops.gemv(torch.randn(1, 8), torch.randn(4, 9))
