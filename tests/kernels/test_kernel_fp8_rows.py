"""Per-token fp8 activation quantization in one kernel (kernels/fp8_rows.py) against the torch roundings
of kernels/fp8.quantize_activations, byte for byte: what cuBLASLt's row-wise GEMM multiplies must be the
reference's e4m3 values and scales, or CPU tests would not speak for the GPU path."""
import pytest
import torch

from llaunch.kernels import dispatch, fp8
from llaunch.kernels.fp8 import DYNAMIC, STATIC, Fp8Weight, quantize_activations


def activations(m: int, k: int, dtype) -> torch.Tensor:
    """Rows as a model has them, and the corners: an outlier column, an all-zero row (the scale's floor),
    a row whose other values e4m3 holds only as subnormals, a row past the scale_ub."""
    x = torch.randn(m, k)
    x[:, min(5, k - 1)] *= 40
    if m > 3:
        x[1] = 0
        x[2] = torch.randn(k) * 1e-4
        x[2, 0] = 1.0
        x[3] *= 50  # (float16 holds it)
    return x.to(dtype)


def layer(k: int, activations: str = DYNAMIC, scale_ub=None) -> Fp8Weight:
    q, scale = fp8.quantize_weight(torch.randn(64, k))  # cuBLASLt's fp8 GEMM takes N and K in multiples of 16
    input_scale = torch.tensor(0.037) if activations == STATIC else None
    return Fp8Weight(q, scale, activations, input_scale, scale_ub)


@pytest.mark.parametrize("m,k", [(1, 64), (5, 1000), (7, 2500), (4, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,scale_ub", [(DYNAMIC, None), (DYNAMIC, 2.5), (STATIC, None)])
def test_rows_quantized_as_the_reference(m, k, dtype, mode, scale_ub):
    x, w = activations(m, k, dtype), layer(k, mode, scale_ub)
    q, scale = dispatch._quantize_rows(x, w)
    want_q, want_scale = quantize_activations(x, w)
    assert scale.shape == (m, 1) and q.dtype == fp8.FP8
    assert torch.equal(scale, want_scale.contiguous())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_strided_rows_and_no_rows():
    """A view whose rows are spaced (a slice of a wider activation) and an empty batch."""
    wide = activations(6, 3000, torch.bfloat16)
    x = wide[:, :2000]
    q, scale = dispatch._quantize_rows(x, layer(2000))
    want_q, want_scale = quantize_activations(x, layer(2000))
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    q, scale = dispatch._quantize_rows(torch.empty(0, 64), layer(64))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [3584, 18944])
@pytest.mark.parametrize("mode,scale_ub", [(DYNAMIC, None), (DYNAMIC, 1.5), (STATIC, None)])
@pytest.mark.parametrize("gemm", ["tensor_epilogue", "rowwise"])
def test_rows_quantized_as_the_reference_gpu(kernel_settings, k, mode, scale_ub, gemm):
    """Qwen2-7B's widths in bf16 on the GPU, 300 rows: the kernel's true-quotient scale and e4m3 cast equal
    torch's, and the GEMM through it (either kernels.fp8_gemm: the per-tensor GEMM with the scales in its epilogue,
    the default, or the row-wise scaled one) equals the same GEMM of the torch-quantized rows."""
    kernel_settings(fp8_gemm=gemm)
    x, w = activations(300, k, torch.bfloat16).cuda(), layer(k, mode, scale_ub)
    w = Fp8Weight(w.weight.cuda(), w.scale.cuda(), w.activations,
                  None if w.input_scale is None else w.input_scale.cuda(), w.scale_ub)
    q, scale = dispatch._quantize_rows(x, w)
    want_q, want_scale = quantize_activations(x, w)
    assert torch.equal(scale, want_scale.contiguous())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    epilogue = dispatch.triton_ops().fp8_epilogue if gemm == "tensor_epilogue" else None
    assert torch.equal(dispatch.fp8_linear(x, w), fp8.scaled_mm_linear(x, w, epilogue=epilogue))
