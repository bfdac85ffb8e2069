"""Rotate-half rotary embedding vs reference.rotary_embedding, on q/k views of a fused qkv."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
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
        q_out, k_out = ops.rotary_embedding(q, k, positions, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_out, ref_q)
    close(k_out, ref_k)


def _qkv_and_caches(tokens, q_heads, kv_heads, dim, dtype, device="cpu"):
    """q/k/v views of one fused projection, NaN caches with spare slots, and shuffled target slots."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, device=device).to(dtype)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
    views = q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    caches = [torch.full((tokens + 5, kv_heads, dim), float("nan"), device=device, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(tokens + 5, device=device)[:tokens]
    return views, caches, slots


def _check_rotary_store(rotary_store_kv, close, poisoned, tokens, heads, dim, dtype, device="cpu", norm=False):
    """norm: Qwen3's / Gemma 3's RMSNorm of each q and k head first (its own weights for q and for k)."""
    cos, sin = reference.rope_cos_sin(dim, 4096, 1e6, device=device)
    (q, k, v), (k_cache, v_cache), slots = _qkv_and_caches(tokens, *heads, dim, dtype, device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    norms = {}
    if norm:
        weights = (1 + 0.3 * torch.randn(2, dim, device=device)).to(dtype)
        norms = dict(q_norm=weights[0], k_norm=weights[1], eps=1e-6)
    with poisoned():
        q_out = rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, **norms)
    if norm:  # the unfused layer: each head through the RMSNorm, then rotated
        q, k = reference.rmsnorm(q, norms["q_norm"], 1e-6), reference.rmsnorm(k, norms["k_norm"], 1e-6)
    ref_q = reference.rotary_store_kv(q, k, v, positions, cos, sin, ref_k_cache, ref_v_cache, slots)
    close(q_out, ref_q)
    # every slot written matches, every other slot is still NaN (nothing written elsewhere)
    torch.testing.assert_close(k_cache, ref_k_cache, equal_nan=True, **_tol(dtype))
    torch.testing.assert_close(v_cache, ref_v_cache, equal_nan=True, atol=0, rtol=0)


def _tol(dtype):
    from conftest import TOLERANCE

    atol, rtol = TOLERANCE[dtype]
    return {"atol": atol, "rtol": rtol}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("heads", [(7, 1), (9, 3)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_store_kv_interpreted(ops, poisoned, close, dtype, tokens, heads, dim, norm):
    _check_rotary_store(ops.rotary_store_kv, close, poisoned, tokens, heads, dim, dtype, norm=norm)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,heads,dim,norm", [(1, (28, 4), 128, False), (4096, (28, 4), 128, False),
                                                   (33, (9, 3), 64, False), (1, (32, 8), 128, True),
                                                   (2048, (32, 4), 128, True), (7, (16, 8), 256, True)])
def test_rotary_store_kv_gpu(cuda, poisoned, close, tokens, heads, dim, norm):
    """Qwen2's shape; with the heads' norms Qwen3-8B's, Qwen3-30B-A3B's and Gemma 3 12B's (256-wide heads)."""
    _check_rotary_store(ops.rotary_store_kv, close, poisoned, tokens, heads, dim, torch.bfloat16, cuda, norm=norm)


def _check_rotary_store_fp8(rotary_store_kv_fp8, close, poisoned, tokens, heads, dim, dtype, device="cpu",
                            norm=False, with_k=True):
    """Into an fp8 cache: q and the returned k as the reference rotates them, the cache's bytes those of
    kernels/fp8.to_fp8 of that k and of v at the layer's scales (kernels/kv_fp8.store_kv's), other slots untouched."""
    from llaunch.kernels.fp8 import FP8, to_fp8

    cos, sin = reference.rope_cos_sin(dim, 4096, 1e6, device=device)
    (q, k, v), _, slots = _qkv_and_caches(tokens, *heads, dim, dtype, device)
    caches = [torch.full((tokens + 5, heads[1], dim), 0x7F, dtype=torch.uint8, device=device).view(FP8)
              for _ in range(2)]  # e4m3's NaN: a slot nothing wrote
    k_scale = k.float().abs().amax() / 448 * 1.5  # a scale that is not the data's own
    v_scale = torch.tensor(0.0173, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    norms = {}
    if norm:
        weights = (1 + 0.3 * torch.randn(2, dim, device=device)).to(dtype)
        norms = dict(q_norm=weights[0], k_norm=weights[1], eps=1e-6)
    with poisoned():
        q_out, k_out = rotary_store_kv_fp8(q, k, v, positions, cos, sin, *caches, slots, k_scale, v_scale,
                                           with_k=with_k, **norms)
    if norm:
        q, k = reference.rmsnorm(q, norms["q_norm"], 1e-6), reference.rmsnorm(k, norms["k_norm"], 1e-6)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_out, ref_q)
    k_cache, v_cache = (c.view(torch.uint8) for c in caches)
    if with_k:
        close(k_out, ref_k)
        assert torch.equal(k_cache[slots], to_fp8(k_out, k_scale).view(torch.uint8))
    else:
        assert k_out is None
    assert torch.equal(v_cache[slots], to_fp8(v, v_scale).view(torch.uint8))
    untouched = torch.ones(tokens + 5, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (k_cache[untouched] == 0x7F).all() and (v_cache[untouched] == 0x7F).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,dim,norm,with_k", [(1, (7, 1), 64, False, True), (19, (9, 3), 128, False, True),
                                                         (19, (9, 3), 64, True, True), (5, (4, 2), 64, False, False)])
def test_rotary_store_kv_fp8_interpreted(ops, poisoned, close, dtype, tokens, heads, dim, norm, with_k):
    _check_rotary_store_fp8(ops.rotary_store_kv_fp8, close, poisoned, tokens, heads, dim, dtype, norm=norm,
                            with_k=with_k)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,heads,dim,norm", [(1, (28, 4), 128, False), (2048, (28, 4), 128, False),
                                                   (33, (9, 3), 64, False), (7, (32, 4), 128, True)])
def test_rotary_store_kv_fp8_gpu(cuda, poisoned, close, tokens, heads, dim, norm):
    """As served: dispatch.rotary_store_kv with an fp8 cache's scales (kernels/kv_fp8.KvScales) takes the kernel."""
    from llaunch.kernels.kv_fp8 import KvScales

    def through_dispatch(q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale, v_scale, with_k, **norms):
        q_out, k_out, v_out = ops.rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots,
                                                  KvScales(k_scale, v_scale), with_kv=True, **norms)
        assert v_out is v  # the chunk's own V, unrounded, as projected
        return q_out, k_out

    _check_rotary_store_fp8(through_dispatch, close, poisoned, tokens, heads, dim, torch.bfloat16, cuda, norm=norm)
