"""Multi-token decode attention: a verify step (speculative decoding) feeds the decode attention
kernel n query tokens per sequence as n entries of the same row with lengths prefix+1 .. prefix+n
(runtime/worker/verify_graphs.py). That must be causal attention of the n-token chunk over the row's
cached prefix: reference.prefill_attention, whose own K/V are already in the cache."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference


def _verify_case(kv_cache, prefixes, n, q_heads, kv_heads, dim, dtype, device="cpu"):
    """Rows with `prefixes` cached tokens and n new ones each (all in the cache). Returns the decode
    layout (q, rows, lengths) and the chunked one (rows, q_starts, q_lens, prefix lens)."""
    k_cache, v_cache, req_to_slots, rows = kv_cache([p + n for p in prefixes], kv_heads, dim, dtype, device)
    b = len(prefixes)
    q = torch.randn(b * n, q_heads, dim, device=device).to(dtype)
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    token_rows = rows.repeat_interleave(n)
    lens = t([p + j + 1 for p in prefixes for j in range(n)])
    chunks = (rows, t([i * n for i in range(b)]), t([n] * b), t(prefixes))
    return k_cache, v_cache, req_to_slots, q, token_rows, lens, chunks


@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("max_len", [None, 40])  # several splits, then one per sequence
@pytest.mark.parametrize("window", [0, 3, 24])  # sliding-window layers: each verify token its own window
def test_verify_tokens_attend_causally_interpreted(ops, poisoned, close, kv_cache, n, max_len, window):
    k_cache, v_cache, slots, q, token_rows, lens, chunks = _verify_case(kv_cache, [0, 17, 70], n, 7, 1, 64,
                                                                         torch.float32)
    with poisoned():
        out = ops.decode_attention(q, k_cache, v_cache, slots, token_rows, lens, 0.125, max_len=max_len,
                                   window=window)
    close(out, reference.prefill_attention(q, k_cache, v_cache, slots, *chunks, 0.125, window=window))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("n", [2, 5])
def test_verify_tokens_attend_causally_gpu(cuda, poisoned, close, kv_cache, batch, n):
    """Qwen2-7B's heads, bf16, contexts up to 4k, in a CUDA graph as the verify graphs replay it
    (max_len fixed at the graph's)."""
    prefixes = torch.randint(1, 4000, (batch,)).tolist()
    k_cache, v_cache, slots, q, token_rows, lens, chunks = _verify_case(kv_cache, prefixes, n, 28, 4, 128,
                                                                         torch.bfloat16, cuda)
    attend = lambda: ops.decode_attention(q, k_cache, v_cache, slots, token_rows, lens, 0.088,  # noqa: E731
                                              max_len=4096)
    with poisoned():
        attend()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    graph.replay()
    close(out, reference.prefill_attention(q, k_cache, v_cache, slots, *chunks, 0.088))
