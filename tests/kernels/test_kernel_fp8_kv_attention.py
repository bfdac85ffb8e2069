"""Decode and prefill attention over an fp8 (e4m3) KV cache, dequantized as the kernels load it, vs
the references reading the same cache through kernels/kv_fp8.Dequantizing (interpreter, CPU)."""
import pytest
import torch

from llaunch.kernels import reference
from llaunch.kernels.fp8 import FP8, to_fp8
from llaunch.kernels.kv_fp8 import Dequantizing


def fp8_caches(k_cache, v_cache):
    """The caches in e4m3 with per-layer scales (their absmax / 448, as calibration would set); the
    slots holding NaN (owned by no sequence) stay NaN."""
    k_scale = torch.nan_to_num(k_cache.float(), nan=0).abs().max() / 448
    v_scale = torch.tensor(0.5)  # the default-like case: a scale that is not the data's
    return to_fp8(k_cache, k_scale), to_fp8(v_cache, v_scale), k_scale, v_scale


@pytest.mark.parametrize("dtype,max_len", [(torch.float16, 250), (torch.float32, 4096)])  # one split; several
def test_decode_reads_an_fp8_cache(ops, poisoned, close, kv_cache, dtype, max_len):
    lengths = [1, 17, 129, 250]
    k_cache, v_cache, req_to_slots, rows = kv_cache(lengths, 2, 64, dtype)
    k8, v8, ks, vs = fp8_caches(k_cache, v_cache)
    assert k8.dtype == FP8
    q = torch.randn(len(lengths), 6, 64).to(dtype)
    seq_lens = torch.tensor(lengths)
    with poisoned():
        out = ops.decode_attention(q, k8, v8, req_to_slots, rows, seq_lens, 0.125, max_len=max_len,
                                   k_scale=ks, v_scale=vs)
    ref = reference.decode_attention(q, Dequantizing(k8, ks, dtype), Dequantizing(v8, vs, dtype), req_to_slots, rows,
                                     seq_lens, 0.125)
    close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16])
def test_prefill_reads_an_fp8_cache(ops, poisoned, close, kv_cache, dtype):
    chunks = [(0, 70), (37, 5), (128, 64)]  # (cached prefix, new tokens)
    k_cache, v_cache, req_to_slots, rows = kv_cache([p + n for p, n in chunks], 1, 64, dtype)
    k8, v8, ks, vs = fp8_caches(k_cache, v_cache)
    prefix_lens = torch.tensor([p for p, _ in chunks])
    q_lens = torch.tensor([n for _, n in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), 3, 64).to(dtype)
    with poisoned():
        out = ops.prefill_attention(q, k8, v8, req_to_slots, rows, q_starts, q_lens, prefix_lens, 0.125,
                                    max_q_len=70, k_scale=ks, v_scale=vs)
    ref = reference.prefill_attention(q, Dequantizing(k8, ks, dtype), Dequantizing(v8, vs, dtype), req_to_slots,
                                      rows, q_starts, q_lens, prefix_lens, 0.125)
    close(out, ref)


def test_prefill_reads_its_chunk_unrounded_and_its_prefix_from_the_fp8_cache(ops, poisoned, close, kv_cache):
    """The interpreter's 64 x 64 tiles: whole blocks of the cached prefix (e4m3 products, scales on the scores and the
    output), the block the prefix ends in (each key from where it lies), whole blocks of the chunk's own keys, and the
    masked diagonal, in every order a chunk's programs meet them."""
    dtype = torch.float16
    # (cached prefix, new tokens): a chunk without a prefix, a short one, whole cached blocks, a prefix ending inside a
    # block before one program's unmasked blocks (100 + 100) and before whole blocks of the chunk's own (30 + 200)
    chunks = [(0, 70), (37, 5), (128, 64), (100, 100), (30, 200)]
    k_cache, v_cache, req_to_slots, rows = kv_cache([p + n for p, n in chunks], 1, 64, dtype)
    k8, v8, ks, vs = fp8_caches(k_cache, v_cache)
    prefix_lens = torch.tensor([p for p, _ in chunks])
    q_lens = torch.tensor([n for _, n in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    tokens = int(q_lens.sum())
    q = torch.randn(tokens, 3, 64).to(dtype)
    kv = torch.randn(tokens, 2, 64).to(dtype)  # k_new and v_new as the qkv split gives them: strided views
    k_new, v_new = kv[:, :1], kv[:, 1:]
    with poisoned():
        out = ops.prefill_attention(q, k8, v8, req_to_slots, rows, q_starts, q_lens, prefix_lens, 0.125,
                                    max_q_len=200, k_scale=ks, v_scale=vs, k_new=k_new, v_new=v_new)
    ref = reference.prefill_attention(q, Dequantizing(k8, ks, dtype), Dequantizing(v8, vs, dtype), req_to_slots,
                                      rows, q_starts, q_lens, prefix_lens, 0.125, k_new, v_new)
    close(out, ref)
    cached = reference.prefill_attention(q, Dequantizing(k8, ks, dtype), Dequantizing(v8, vs, dtype), req_to_slots,
                                         rows, q_starts, q_lens, prefix_lens, 0.125)
    assert not torch.allclose(out.float(), cached.float(), atol=1e-2)  # the chunk's K/V were read from k_new
