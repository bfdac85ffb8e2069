"""Rotate-half rotary embedding vs reference.rotary_embedding, on q/k views of a fused qkv."""
import pytest
import torch

from llaunch import kernels
from llaunch.kernels import reference


def _qkv(tokens, q_heads, kv_heads, dim, dtype, device="cpu"):
    """q and k as views into one [T, (Hq + 2 Hk) D] projection output, as the models produce."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, device=device).to(dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 129])
@pytest.mark.parametrize("heads", [(7, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_interpreted(ops, poisoned, close, dtype, tokens, heads, dim):
    cos, sin = reference.rope_cos_sin(dim, 4096, 1e6)
    q, k = _qkv(tokens, *heads, dim, dtype)
    positions = torch.randint(0, 4096, (tokens,))
    with poisoned():
        q_out, k_out = ops.rotary_embedding(q, k, positions, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_out, ref_q)
    close(k_out, ref_k)


def test_rotary_llama3_scaled_tables(ops, poisoned, close):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cos, sin = reference.rope_cos_sin(64, 20000, 5e5, scaling)
    q, k = _qkv(5, 9, 3, 64, torch.float32)
    positions = torch.tensor([0, 1, 8191, 12000, 19999])
    with poisoned():
        q_out, k_out = ops.rotary_embedding(q, k, positions, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_out, ref_q)
    close(k_out, ref_k)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,heads,dim", [(4096, (28, 4), 128), (64, (28, 4), 128), (1000, (9, 3), 64)])
def test_rotary_gpu(cuda, poisoned, close, tokens, heads, dim):
    cos, sin = reference.rope_cos_sin(dim, 32768, 1e6, device=cuda)
    q, k = _qkv(tokens, *heads, dim, torch.bfloat16, cuda)
    positions = torch.randint(0, 32768, (tokens,), device=cuda)
    with poisoned():
        q_out, k_out = kernels.rotary_embedding(q, k, positions, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_out, ref_q)
    close(k_out, ref_k)
