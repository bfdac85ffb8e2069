"""The fp8 GEMM's scales applied after it (kernels/fp8_epilogue.py, kernels.fp8_gemm=tensor_epilogue): each unscaled
sum times its token's and its channel's scale, rounded to the model's dtype, the bias added to that and rounded
again (the row-wise path's `y + bias`), against the same operations in torch, element for element."""
import pytest
import torch

from conftest import INTERPRETED


def want(y, row_scales, channel_scales, bias, dtype):
    out = (y.float() * row_scales.reshape(-1, 1) * channel_scales.reshape(1, -1)).to(dtype)
    return out if bias is None else (out.float() + bias.float()).to(dtype)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter tests need TRITON_INTERPRET=1")
@pytest.mark.parametrize("m,n", [(1, 64), (7, 1500), (3, 2048)])  # 1,500: a partial tile of columns
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # bf16 out: on the GPU (the interpreter truncates)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scales_and_bias_as_torch_applies_them(poisoned, m, n, dtype, with_bias):
    from llaunch.kernels.fp8_epilogue import scale_rows_and_channels

    y = (torch.randn(m, n) * 3000).to(torch.bfloat16)  # sums of e4m3 products: large, as cuBLASLt writes them
    row_scales, channel_scales = torch.rand(m, 1) / 448 + 1e-4, torch.rand(n) / 448 + 1e-4
    bias = torch.randn(n).to(dtype) if with_bias else None
    with poisoned():
        got = scale_rows_and_channels(y, row_scales, channel_scales, bias, dtype)
    assert got.dtype == dtype and torch.equal(got, want(y, row_scales, channel_scales, bias, dtype))


@pytest.mark.skipif(not INTERPRETED, reason="interpreter tests need TRITON_INTERPRET=1")
def test_a_strided_sum_and_no_rows():
    from llaunch.kernels.fp8_epilogue import scale_rows_and_channels

    wide = torch.randn(5, 300).to(torch.bfloat16)
    y, rows, cols = wide[:, :200], torch.rand(5), torch.rand(200)
    got = scale_rows_and_channels(y, rows, cols, None, torch.float16)
    assert torch.equal(got, want(y, rows, cols, None, torch.float16))
    assert scale_rows_and_channels(torch.empty(0, 64), rows[:0], cols[:64], None, torch.float16).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU and TRITON_INTERPRET=0")
@pytest.mark.parametrize("m,n,with_bias", [(64, 37888, False), (300, 4608, True)])
def test_scales_and_bias_as_torch_applies_them_gpu(m, n, with_bias):
    from llaunch.kernels.fp8_epilogue import scale_rows_and_channels

    y = (torch.randn(m, n, device="cuda") * 3000).to(torch.bfloat16)
    rows, cols = torch.rand(m, 1, device="cuda") / 448 + 1e-4, torch.rand(n, device="cuda") / 448 + 1e-4
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if with_bias else None
    got = scale_rows_and_channels(y, rows, cols, bias, torch.bfloat16)
    assert torch.equal(got, want(y, rows, cols, bias, torch.bfloat16))
