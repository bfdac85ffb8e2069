"""GeGLU's gelu_tanh-and-multiply vs reference.gelu_tanh_mul (Gemma's MLP)."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 123), (1, 2 * 64), (17, 2 * 1537)])
def test_gelu_tanh_mul_interpreted(ops, poisoned, close, dtype, shape):
    x = (4 * torch.randn(shape)).to(dtype)  # gate values well into both tails
    with poisoned():
        out = ops.gelu_tanh_mul(x)
    close(out, reference.gelu_tanh_mul(x))


def test_gelu_tanh_mul_strided_rows(ops, poisoned, close):
    x = torch.randn(6, 2 * 100 + 5)[:, : 2 * 100]  # a view: row stride 205
    with poisoned():
        out = ops.gelu_tanh_mul(x)
    close(out, reference.gelu_tanh_mul(x))


def test_reference_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    x = 3 * torch.randn(7, 2 * 33)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(reference.gelu_tanh_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2 * 15360), (64, 2 * 15360), (3, 2 * 1536)])  # Gemma 3 12B's MLP
def test_gelu_tanh_mul_gpu(cuda, poisoned, close, shape):
    x = (3 * torch.randn(shape, device=cuda)).to(torch.bfloat16)
    with poisoned():
        out = ops.gelu_tanh_mul(x)
    close(out, reference.gelu_tanh_mul(x))
