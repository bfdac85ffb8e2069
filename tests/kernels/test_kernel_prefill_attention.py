"""Variable-length causal prefill attention over cached prefixes vs reference.prefill_attention."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference

# (prefix already cached, new tokens) per sequence, all in one call.
MIXED = [(0, 17), (40, 1), (5, 129), (0, 1), (64, 64)]
HEADS = [(7, 1), (3, 1), (2, 2)]


def _run(attend, chunks, q_heads, kv_heads, dim, dtype, kv_cache, device="cpu", hint=True, q_view=False, **masks):
    k_cache, v_cache, req_to_slots, rows = kv_cache([p + n for p, n in chunks], kv_heads, dim, dtype, device)
    prefix_lens = torch.tensor([p for p, _ in chunks], device=device)
    q_lens = torch.tensor([n for _, n in chunks], device=device)
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    tokens = int(q_lens.sum())
    if q_view:  # q as a view into a fused qkv projection (token stride > Hq * D)
        q = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, device=device).to(dtype)[:, : q_heads * dim]
        q = q.view(tokens, q_heads, dim)
    else:
        q = torch.randn(tokens, q_heads, dim, device=device).to(dtype)
    scale = dim ** -0.5
    hints = {"max_q_len": max(n for _, n in chunks)} if hint else {}
    out = attend(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens, prefix_lens, scale, **hints, **masks)
    return out, reference.prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens,
                                            prefix_lens, scale, **masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_mixed_batch_interpreted(ops, poisoned, close, kv_cache, dtype, heads, dim):
    with poisoned():
        out, ref = _run(ops.prefill_attention, MIXED, *heads, dim, dtype, kv_cache)
    close(out, ref)


@pytest.mark.parametrize("chunks", [[(0, 1)], [(37, 1)], [(0, 123)], [(200, 5)]])
def test_prefill_single_sequence_interpreted(ops, poisoned, close, kv_cache, chunks):
    with poisoned():
        out, ref = _run(ops.prefill_attention, chunks, 7, 1, 64, torch.float32, kv_cache)
    close(out, ref)


def test_prefill_without_length_hint_and_strided_q(ops, poisoned, close, kv_cache):
    with poisoned():
        out, ref = _run(ops.prefill_attention, MIXED[:3], 3, 1, 64, torch.float32, kv_cache, hint=False,
                        q_view=True)
    close(out, ref)


# windows shorter than a block, of a block, across blocks, longer than every context; one query sees only itself
@pytest.mark.parametrize("window", [1, 5, 63, 64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_sliding_window_interpreted(ops, poisoned, close, kv_cache, window, dtype):
    with poisoned():
        out, ref = _run(ops.prefill_attention, MIXED, 7, 1, 64, dtype, kv_cache, window=window)
    close(out, ref)


@pytest.mark.parametrize("window", [0, 17])
def test_prefill_softcap_interpreted(ops, poisoned, close, kv_cache, window):
    """Gemma 2's soft-capping (scores scaled up so the cap bends them), with and without a window."""
    with poisoned():
        out, ref = _run(ops.prefill_attention, MIXED, 3, 1, 64, torch.float32, kv_cache, window=window, softcap=0.5)
    close(out, ref)
    _, uncapped = _run(ops.prefill_attention, MIXED, 3, 1, 64, torch.float32, kv_cache, window=window)
    assert not torch.allclose(ref, uncapped, atol=1e-3)  # the cap changes the result at these scores


def test_reference_window_is_attention_over_the_last_window_positions(kv_cache):
    """The reference's window against its own causal attention over a cache row that holds only each query's
    last `window` positions: one query at a time, its visible keys cut out of the row."""
    window, chunks = 7, [(20, 9), (0, 12)]
    k_cache, v_cache, req_to_slots, rows = kv_cache([p + n for p, n in chunks], 2, 16, torch.float32)
    q_lens = torch.tensor([n for _, n in chunks])
    prefix_lens = torch.tensor([p for p, _ in chunks])
    q = torch.randn(int(q_lens.sum()), 4, 16)
    out = reference.prefill_attention(q, k_cache, v_cache, req_to_slots, rows, torch.cumsum(q_lens, 0) - q_lens,
                                      q_lens, prefix_lens, 0.25, window=window)
    token = 0
    for row, (p, n) in zip(rows.tolist(), chunks):
        for pos in range(p, p + n):
            first = max(0, pos - window + 1)
            cut = req_to_slots[row: row + 1, first: pos + 1].clone()
            one = reference.decode_attention(q[token: token + 1], k_cache, v_cache, cut, torch.tensor([0]),
                                             torch.tensor([pos + 1 - first]), 0.25)
            torch.testing.assert_close(out[token: token + 1], one)
            token += 1


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1024, 4096])
@pytest.mark.parametrize("heads,dim", [((16, 8), 256), ((40, 10), 128)])  # Gemma 3 12B's local layers, Phi-4's
def test_prefill_sliding_window_gpu(cuda, poisoned, close, kv_cache, window, heads, dim):
    with poisoned():
        out, ref = _run(ops.prefill_attention, [(0, 3000), (1500, 700), (0, 1)], *heads, dim, torch.bfloat16,
                        kv_cache, cuda, q_view=True, window=window, softcap=50.0 if dim == 256 else 0.0)
    close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [[(0, 4096)], [(0, 1024), (1000, 2048), (0, 1), (3000, 17)],
                                    [(0, 129)] * 16])
@pytest.mark.parametrize("heads,dim", [((28, 4), 128), ((9, 3), 64)])
def test_prefill_gpu(cuda, poisoned, close, kv_cache, chunks, heads, dim):
    with poisoned():
        out, ref = _run(ops.prefill_attention, chunks, *heads, dim, torch.bfloat16, kv_cache, cuda,
                        q_view=True)
    close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dim", [((28, 4), 128), ((9, 3), 64)])
def test_prefill_float32_gpu(cuda, poisoned, close, kv_cache, heads, dim):
    """float32 models (SmolLM2's checkpoint) on a GPU: three-pass TF32 dots stay within float32
    tolerance of the IEEE reference."""
    with poisoned():
        out, ref = _run(ops.prefill_attention, [(0, 512), (100, 300)], *heads, dim, torch.float32, kv_cache,
                        cuda, q_view=True)
    close(out, ref)
