"""The few-rows linear layer (kernels/gemv_rows.py, kernels.gemv_rows): 2 to 8 rows of x through one pass over
the weights, against torch's product of the same tensors in float32 rounded once to the dtype, as cuBLAS returns
it: float32 under the interpreter, bf16 on a GPU at Qwen2-7B's shapes. Through dispatch only where the setting
reaches the row count."""
import pytest
import torch
import torch.nn.functional as F

from llaunch.kernels import dispatch as ops
from llaunch.kernels import gemv_rows as gr

SHAPES = [(37, 300), (64, 1000), (5, 17)]  # N, K: tiles that neither divides


def _case(m, n, k, dtype, device, bias: bool):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    return x, w, b, want


@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rows_equal_the_float32_product(m, n, k, bias):
    x, w, b, want = _case(m, n, k, torch.float32, "cpu", bias)
    torch.testing.assert_close(gr.gemv_rows(x, w, b), want, rtol=1e-5, atol=1e-5)


def test_a_strided_weight_and_too_many_rows():
    x, w, _, want = _case(4, 40, 64, torch.float32, "cpu", False)
    wide = torch.zeros(40, 128)
    wide[:, :64] = w
    torch.testing.assert_close(gr.gemv_rows(x, wide[:, :64].t().contiguous().t()), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        gr.gemv_rows(torch.randn(9, 64), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_rows_at_qwen2_7b_shapes_gpu(m, n, k, kernel_settings):
    """bf16: every output within one bf16 step of the float32 product's rounding (the sum's order differs from
    cuBLAS's), nearly all equal to it; dispatch takes the kernel for 2..gemv_rows rows and cuBLAS past them."""
    x, w, b, want = _case(m, n, k, torch.bfloat16, "cuda", n == 4608)
    got = gr.gemv_rows(x, w, b)
    step = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-3)
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.95
    kernel_settings(gemv_rows=8)
    assert torch.equal(ops.linear(x, w, b), got)
    kernel_settings(gemv_rows=m - 1 if m > 2 else 1)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))


def test_the_setting_takes_1_to_8_rows():
    from llaunch.kernels.settings import KernelSettings

    assert KernelSettings(gemv_rows=8).problems() == [] and KernelSettings().gemv_rows == 1
    for rows in (0, 9):
        assert [key for key, _ in KernelSettings(gemv_rows=rows).problems()] == ["kernels.gemv_rows"]
