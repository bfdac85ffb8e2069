"""Fused residual-add RMSNorm vs reference.rmsnorm."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference

SHAPES = [(5, 123), (1, 64), (17, 576)]


def _inputs(shape, dtype, device="cpu", strided=False):
    rows, n = shape
    x = torch.randn(rows, n + 9 if strided else n, device=device).to(dtype)[:, :n]  # row stride != n
    return x, torch.randn(rows, n, device=device).to(dtype), (1 + 0.1 * torch.randn(n, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_rmsnorm_interpreted(ops, poisoned, close, dtype, shape, strided):
    x, residual, weight = _inputs(shape, dtype, strided=strided)
    with poisoned():
        out = ops.rmsnorm(x, weight, 1e-6)
        out_r, h = ops.rmsnorm(x, weight, 1e-5, residual)
    close(out, reference.rmsnorm(x, weight, 1e-6))
    ref_out, ref_h = reference.rmsnorm(x, weight, 1e-5, residual)
    close(out_r, ref_out)
    close(h, ref_h)


def test_rmsnorm_3d_input(ops, poisoned, close):
    x = torch.randn(2, 3, 96)
    weight = torch.randn(96)
    with poisoned():
        out = ops.rmsnorm(x, weight, 1e-6)
    close(out, reference.rmsnorm(x, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 3584), (64, 3584), (1, 576), (3001, 576)])
def test_rmsnorm_gpu(cuda, poisoned, close, shape):
    x, residual, weight = _inputs(shape, torch.bfloat16, cuda)
    with poisoned():
        out, h = ops.rmsnorm(x, weight, 1e-6, residual)
    ref_out, ref_h = reference.rmsnorm(x, weight, 1e-6, residual)
    close(out, ref_out)
    close(h, ref_h)
