"""Scatter of new K/V into cache slots vs reference.store_kv: written slots match, others untouched."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference


def _check(store, tokens, kv_heads, dim, dtype, device="cpu"):
    num_slots = 2 * tokens + 11
    kv = torch.randn(tokens, 2 * kv_heads * dim + 3, device=device).to(dtype)  # views with a token stride
    k = kv[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    v = kv[:, kv_heads * dim : 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    slots = torch.randperm(num_slots, device=device)[:tokens]
    k_cache = torch.full((num_slots, kv_heads, dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store(k_cache, v_cache, slots, k, v)
    reference.store_kv(ref_k, ref_v, slots, k, v)
    assert torch.equal(k_cache[slots], ref_k[slots]) and torch.equal(v_cache[slots], ref_v[slots])
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 129])
@pytest.mark.parametrize("kv_heads,dim", [(1, 64), (3, 64), (4, 128)])
def test_store_kv_interpreted(ops, dtype, tokens, kv_heads, dim):
    _check(ops.store_kv, tokens, kv_heads, dim, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,kv_heads,dim", [(4096, 4, 128), (64, 4, 128), (999, 3, 64)])
def test_store_kv_gpu(cuda, tokens, kv_heads, dim):
    _check(ops.store_kv, tokens, kv_heads, dim, torch.bfloat16, cuda)
