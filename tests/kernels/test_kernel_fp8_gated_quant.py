"""The fp8 MLP's middle in one kernel (kernels/fp8_gated_quant.py) against the three kernels it replaces, run one
after the other (the row × channel scales of kernels/fp8_epilogue.py, the activation of kernels/gated_activation.py,
the per-token e4m3 of kernels/fp8_rows.py), byte for byte: down_proj must multiply the same e4m3 values and
scales either way. Then the values themselves against torch: act(gate) · up within e4m3's rounding."""
import pytest
import torch

from conftest import HAS_GPU, INTERPRETED
from llaunch.kernels import dispatch, fp8
from llaunch.kernels.fp8_epilogue import scale_rows_and_channels
from llaunch.kernels.fp8_gated_quant import gated_quantize
from llaunch.kernels.fp8_rows import quantize_rows
from llaunch.kernels.gated_activation import GELU_TANH, SILU, gelu_tanh_mul, silu_mul


def sums(m: int, inner: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gate‖up GEMM's unscaled bfloat16 sums (e4m3 products: tens to hundreds), its token and channel scales;
    a row of zeros (the scale's floor) and one far larger than the others."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(m, 2 * inner, generator=g) * 60
    if m > 2:
        y[1] = 0
        y[2] *= 30
    rows = torch.rand(m, 1, generator=g) * 0.02 + 1e-3
    channels = torch.rand(2 * inner, generator=g) * 0.01 + 1e-4
    return y.to(torch.bfloat16), rows, channels


def unfused(y, dtype, rows, channels, scale_ub, static, act):
    h = scale_rows_and_channels(y, rows, channels, None, dtype) if rows is not None else y.to(dtype)
    a = silu_mul(h) if act == SILU else gelu_tanh_mul(h)
    return quantize_rows(a, scale_ub, static)


@pytest.fixture(params=["one pass", "tiles"])
def row_pass(request, monkeypatch):
    """A row held whole in registers, or (a row wider than ROW_IN_REGISTERS) read twice in tiles."""
    from llaunch.kernels import fp8_gated_quant

    if request.param == "tiles":
        monkeypatch.setattr(fp8_gated_quant, "ROW_IN_REGISTERS", 32)
        monkeypatch.setattr(fp8_gated_quant, "BLOCK", 256)
    return request.param


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test (the GPU one below takes real shapes)")
@pytest.mark.parametrize("m,inner", [(3, 40), (5, 1100), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("act", [SILU, GELU_TANH])
@pytest.mark.parametrize("scale_ub,static", [(None, None), (0.8, None), (None, torch.tensor(0.011))])
def test_as_the_three_kernels_it_replaces(m, inner, dtype, scaled, act, scale_ub, static):
    y, rows, channels = sums(m, inner)
    if not scaled:  # the row-wise GEMM's output: already scaled, activations of a model's size
        y, rows, channels = (y.float() / 200).to(torch.bfloat16), None, None
    q, s = gated_quantize(y, dtype, rows, channels, scale_ub, static, act)
    want_q, want_s = unfused(y, dtype, rows, channels, scale_ub, static, act)
    assert q.shape == (m, inner) and q.dtype == fp8.FP8 and s.shape == (m, 1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_row_is_held_as_two_power_of_two_blocks():
    """The one-pass program's row: the largest power of two, then the rest rounded up, not one block of
    next_power_of_2 (Qwen2-7B's 18,944 columns: 20,480 lanes, not 32,768)."""
    from llaunch.kernels.fp8_gated_quant import row_blocks

    assert row_blocks(18944) == (16384, 4096)
    assert row_blocks(1100) == (1024, 128) and row_blocks(40) == (32, 8)
    assert row_blocks(64) == (64, 0) and row_blocks(1) == (1, 0) and row_blocks(29568) == (16384, 16384)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test (the GPU one below takes real shapes)")
@pytest.mark.parametrize("row_pass", ["tiles"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("scale_ub,static", [(None, None), (0.8, None), (None, torch.tensor(0.011))])
def test_rows_wider_than_the_registers_take_tiles_alike(row_pass, dtype, scaled, scale_ub, static):
    """Rows of more than ROW_IN_REGISTERS columns: read twice, the same bytes as the three kernels."""
    test_as_the_three_kernels_it_replaces(5, 1100, dtype, scaled, SILU, scale_ub, static)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
def test_the_values_are_the_activation_within_e4m3():
    y, rows, channels = sums(6, 300, seed=3)
    q, s = gated_quantize(y, torch.float32, rows, channels)
    h = y.float() * rows * channels
    gate, up = h[:, :300], h[:, 300:]
    want = torch.nn.functional.silu(gate) * up
    got = q.float() * s
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of each value, or of the row's smallest step
    tol = want.abs() / 16 + s * 2 ** -9
    assert ((got - want).abs() <= tol + 1e-7).all()
    assert torch.equal(s[1], torch.tensor([fp8.MIN_SCALE]))  # the zero row: the floor, all zeros
    assert not q[1].float().any()


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
@pytest.mark.parametrize("rows", [5, 600])
@pytest.mark.parametrize("gemm", ["tensor_epilogue", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("down_activations", [fp8.DYNAMIC, fp8.STATIC])
def test_an_mlp_through_dispatch_as_the_unfused_kernels(monkeypatch, kernel_settings, rows, gemm, dtype,
                                                         down_activations):
    """The decoder's MLP ops (gated_linear with down_proj's weight, then linear) on the fused path give the output of
    the unfused GPU path, at either kernels.fp8_gemm: the Triton path taken on CPU tensors (the interpreter;
    torch._scaled_mm runs on the CPU too)."""
    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    kernel_settings(fp8_fused_mlp=True, fp8_gemm=gemm)
    g = torch.Generator().manual_seed(rows)
    hidden, inner = 64, 96
    gate_up = fp8.Fp8Weight(*fp8.quantize_weight(torch.randn(2 * inner, hidden, generator=g) * 0.02))
    q, scale = fp8.quantize_weight(torch.randn(hidden, inner, generator=g) * 0.02)
    down = fp8.Fp8Weight(q, scale, down_activations, torch.tensor(0.01) if down_activations == fp8.STATIC else None)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    assert isinstance(dispatch.gated_linear(x, gate_up, down), dispatch.QuantizedRows)
    fused = dispatch.linear(dispatch.gated_linear(x, gate_up, down), down)
    ops = dispatch.triton_ops()
    epilogue = ops.fp8_epilogue if gemm == "tensor_epilogue" else None
    h = ops.silu_mul(fp8.scaled_mm_linear(x, gate_up, quantize=dispatch._quantize_rows, epilogue=epilogue))
    unfused = fp8.scaled_mm_linear(h, down, quantize=dispatch._quantize_rows, epilogue=epilogue)
    assert fused.shape == (rows, hidden) and fused.dtype == dtype
    assert torch.equal(fused, unfused)


def test_refuses_what_it_cannot_read():
    y, rows, channels = sums(2, 16)
    with pytest.raises(ValueError, match="together"):
        gated_quantize(y, torch.bfloat16, rows, None)
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        gated_quantize(y[:, :31], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [64, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_as_the_three_kernels_at_qwen2_7b_width_gpu(row_pass, m, dtype):
    y, rows, channels = (t.cuda() for t in sums(m, 18944))
    for scaled in (True, False):
        r, c = (rows, channels) if scaled else (None, None)
        q, s = gated_quantize(y, dtype, r, c)
        want_q, want_s = unfused(y, dtype, r, c, None, None, SILU)
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
