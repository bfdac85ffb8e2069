"""Grouped-query flash-decoding attention vs reference.decode_attention."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference

LENGTHS = [1, 17, 129, 64, 250]
HEADS = [(7, 1), (3, 1), (2, 2)]


def _run(attend, lengths, q_heads, kv_heads, dim, dtype, kv_cache, device="cpu", window=0, softcap=0.0, **hints):
    k_cache, v_cache, req_to_slots, rows = kv_cache(lengths, kv_heads, dim, dtype, device)
    seq_lens = torch.tensor(lengths, device=device)
    q = torch.randn(len(lengths), q_heads, dim, device=device).to(dtype)
    scale = dim ** -0.5
    masks = dict(window=window, softcap=softcap)
    out = attend(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale, **hints, **masks)
    return out, reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale, **masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_mixed_batch_interpreted(ops, poisoned, close, kv_cache, dtype, heads, dim):
    with poisoned():
        out, ref = _run(ops.decode_attention, LENGTHS, *heads, dim, dtype, kv_cache, max_len=max(LENGTHS))
    close(out, ref)


@pytest.mark.parametrize("max_len", [None, 1, 64, 4096])
def test_decode_split_count_never_changes_the_result(ops, poisoned, close, kv_cache, max_len):
    # max_len only sets how many chunks a sequence is cut into; an under-estimate stays correct
    with poisoned():
        out, ref = _run(ops.decode_attention, LENGTHS, 3, 1, 64, torch.float32, kv_cache, max_len=max_len)
    close(out, ref)


def test_decode_single_token_context(ops, poisoned, close, kv_cache):
    with poisoned():
        out, ref = _run(ops.decode_attention, [1], 7, 1, 128, torch.float32, kv_cache, max_len=1)
    close(out, ref)


@pytest.mark.parametrize("max_len", [9, 4096])  # one split (no merge pass), several splits
def test_decode_empty_padding_row_gives_zeros(ops, poisoned, kv_cache, max_len):
    # CUDA-graph batches are padded with rows of length 0: they must come out as the reference's zeros
    k_cache, v_cache, req_to_slots, rows = kv_cache([5, 9], 1, 64, torch.float32)
    q = torch.randn(2, 3, 64)
    seq_lens = torch.tensor([5, 0])
    with poisoned():
        out = ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.125, max_len=max_len)
    ref = reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.125)
    assert torch.equal(ref[1], torch.zeros_like(ref[1])) and torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("max_len", [None, 250])  # several splits of the window, one per sequence
@pytest.mark.parametrize("window", [1, 16, 31, 64, 200, 1000])
def test_decode_sliding_window_interpreted(ops, poisoned, close, kv_cache, window, max_len):
    with poisoned():
        out, ref = _run(ops.decode_attention, LENGTHS, 7, 1, 64, torch.float32, kv_cache, max_len=max_len,
                        window=window)
    close(out, ref)


@pytest.mark.parametrize("window", [0, 33])
def test_decode_softcap_interpreted(ops, poisoned, close, kv_cache, window):
    with poisoned():
        out, ref = _run(ops.decode_attention, LENGTHS, 3, 1, 64, torch.float32, kv_cache, max_len=4096,
                        window=window, softcap=0.5)
    close(out, ref)


@pytest.mark.parametrize("max_len", [9, 4096])
def test_decode_windowed_padding_row_gives_zeros(ops, poisoned, kv_cache, max_len):
    k_cache, v_cache, req_to_slots, rows = kv_cache([50, 9], 1, 64, torch.float32)
    q = torch.randn(2, 3, 64)
    seq_lens = torch.tensor([50, 0])
    with poisoned():
        out = ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.125, max_len=max_len,
                                   window=8)
    ref = reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.125, window=8)
    assert torch.equal(ref[1], torch.zeros_like(ref[1])) and torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=1e-5)


def test_reference_window_is_attention_over_the_last_window_tokens(kv_cache):
    """The reference's window equals attending to a row that starts at the window's first token."""
    k_cache, v_cache, req_to_slots, rows = kv_cache(LENGTHS, 2, 32, torch.float32)
    q = torch.randn(len(LENGTHS), 6, 32)
    seq_lens = torch.tensor(LENGTHS)
    out = reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.2, window=20)
    first = (seq_lens - 20).clamp(min=0)
    shifted = torch.stack([req_to_slots[r].roll(-int(f)) for r, f in zip(rows.tolist(), first.tolist())])
    ref = reference.decode_attention(q, k_cache, v_cache, shifted, torch.arange(len(LENGTHS)), seq_lens - first, 0.2)
    torch.testing.assert_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dim,softcap", [((16, 8), 256, 50.0), ((40, 10), 128, 0.0)])  # Gemma 3 12B, Phi-4
@pytest.mark.parametrize("batch,max_len", [(64, 4096), (1, 8192)])
def test_decode_sliding_window_gpu(cuda, poisoned, close, kv_cache, heads, dim, softcap, batch, max_len):
    lengths = torch.randint(1, max_len + 1, (batch,)).tolist()
    with poisoned():
        out, ref = _run(ops.decode_attention, lengths, *heads, dim, torch.bfloat16, kv_cache, cuda,
                        max_len=max_len, window=1024, softcap=softcap)
    close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dim", [((28, 4), 128), ((9, 3), 64)])
@pytest.mark.parametrize("batch,max_len", [(64, 1024), (1, 4096), (256, 512)])
def test_decode_gpu(cuda, poisoned, close, kv_cache, heads, dim, batch, max_len):
    lengths = torch.randint(max_len // 2, max_len + 1, (batch,)).tolist()
    lengths[0] = 1
    with poisoned():
        out, ref = _run(ops.decode_attention, lengths, *heads, dim, torch.bfloat16, kv_cache, cuda,
                        max_len=max_len)
    close(out, ref)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph(cuda, close, kv_cache):
    lengths = [1000] * 64
    k_cache, v_cache, req_to_slots, rows = kv_cache(lengths, 4, 128, torch.bfloat16, cuda)
    q = torch.randn(64, 28, 128, device=cuda).to(torch.bfloat16)
    seq_lens = torch.tensor(lengths, device=cuda)
    attend = lambda: ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.088,  # noqa: E731
                                              max_len=1000)
    attend()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for _ in range(2):  # new inputs in the captured buffers, then replay
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        seq_lens.copy_(torch.randint(1, 1001, (64,), device=cuda))
        graph.replay()
        close(out, reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.088))


@pytest.mark.parametrize("row_invariant", [False, True])
def test_row_invariant_splits_each_row_as_a_one_row_step(ops, kv_cache, kernel_settings, row_invariant):
    """kernels.row_invariant: a row of a 5-row step (a verify step's tokens) gets the bits it gets alone (batch-1
    decode): its context is cut into the chunks a one-row step cuts it into. Without it the step's split count
    follows its rows, and the merged sums round otherwise."""
    kernel_settings(row_invariant=row_invariant)
    lengths = [2000, 2001, 2002, 2003, 2004]  # one request's verify tokens: each sees one more cached token
    k_cache, v_cache, req_to_slots, rows = kv_cache(lengths, 1, 64, torch.float16, "cpu")
    seq_lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), 7, 64).half()
    step = ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, 0.125, max_len=4096)
    alone = torch.cat([ops.decode_attention(q[i:i + 1], k_cache, v_cache, req_to_slots, rows[i:i + 1],
                                            seq_lens[i:i + 1], 0.125, max_len=max_len)
                       for i, max_len in enumerate([4096, 4096, 2048, 2004, None])])  # graph or eager steps
    assert torch.equal(step, alone) == row_invariant


def test_row_invariant_leaves_steps_past_16_rows_their_batch_split(ops, kv_cache, kernel_settings, monkeypatch):
    """A step of more than 16 rows (settings.INVARIANT_ROWS) is not row-invariant anyway (cuBLAS sums its linears): it
    keeps the batch's split count, not one row's (at batch 256 that would be 65k programs a layer)."""
    from llaunch.kernels import decode_attention as da

    seen = []
    real = da.num_splits_for
    monkeypatch.setattr(da, "num_splits_for", lambda batch, heads, longest: seen.append((batch, longest)) or
                        real(batch, heads, longest))
    kernel_settings(row_invariant=True)
    for n in (16, 17):
        k_cache, v_cache, req_to_slots, rows = kv_cache([40] * n, 1, 64, torch.float32, "cpu")
        q, lens = torch.randn(n, 2, 64), torch.tensor([40] * n)
        ops.decode_attention(q, k_cache, v_cache, req_to_slots, rows, lens, 0.125, max_len=64)
    assert seen == [(1, req_to_slots.shape[1]), (17, 64)]
