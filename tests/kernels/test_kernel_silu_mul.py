"""SiLU-and-multiply vs reference.silu_mul."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 123), (1, 2 * 64), (17, 2 * 1537)])
def test_silu_mul_interpreted(ops, poisoned, close, dtype, shape):
    x = (3 * torch.randn(shape)).to(dtype)
    with poisoned():
        out = ops.silu_mul(x)
    close(out, reference.silu_mul(x))


def test_silu_mul_strided_rows(ops, poisoned, close):
    x = torch.randn(6, 2 * 100 + 5)[:, : 2 * 100]  # a view: row stride 205
    with poisoned():
        out = ops.silu_mul(x)
    close(out, reference.silu_mul(x))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2 * 18944), (64, 2 * 18944), (3, 2 * 1536)])
def test_silu_mul_gpu(cuda, poisoned, close, shape):
    x = (3 * torch.randn(shape, device=cuda)).to(torch.bfloat16)
    with poisoned():
        out = ops.silu_mul(x)
    close(out, reference.silu_mul(x))
