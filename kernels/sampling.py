"""Sampling on the device with no host sync: penalties, then temperature / top-k / top-p and a seeded
exponential race (Gumbel-max) whose noise is the reference's counter-based hash, so a seeded row
draws the same token on GPU as on CPU for the same logits (up to float rounding: a draw can differ
only when two tokens' race scores agree to about 1e-7).

The top-k/top-p kept set is the tokens whose logit is at least a per-row threshold, found without a
sort (bisection over probabilities; skipped when the caller promises that no row filters). Then a
program per vocabulary chunk races its kept tokens (p_i / E_i, relative to the chunk's top logit, or
the raw logit for greedy rows) and a last kernel picks the best chunk per row. Differences from
reference.sample, all at rounding level: ties at the threshold keep every tied token (the reference
keeps an arbitrary subset), and a row with top_p >= 1 keeps the low tail that the reference's float
cumsum can round away.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _penalties_kernel(logits_ptr, counts_ptr, seen_ptr, presence_ptr, frequency_ptr, repetition_ptr, out_ptr,
                      vocab, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    at = b * vocab + cols
    logit = tl.load(logits_ptr + at, mask=mask, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + at, mask=mask, other=0).to(tl.float32)
    seen = tl.load(seen_ptr + at, mask=mask, other=0) != 0
    logit = logit - tl.load(frequency_ptr + b) * count - tl.load(presence_ptr + b) * (count > 0).to(tl.float32)
    rep = tl.load(repetition_ptr + b)
    penalized = tl.where(logit > 0, logit / rep, logit * rep)
    tl.store(out_ptr + at, tl.where(seen, penalized, logit).to(out_ptr.dtype.element_ty), mask=mask)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Presence/frequency penalties over output counts [B, V] and the repetition penalty over tokens
    seen in prompt or output (`seen` [B, V] bool); per-row values [B]. Returns new logits."""
    batch, vocab = logits.shape
    logits, counts, seen = logits.contiguous(), counts.contiguous(), seen.contiguous()
    out_dtype = logits.dtype  # torch's promotion, as the reference's arithmetic gets it
    for t in (presence, frequency, repetition) + ((counts,) if counts.is_floating_point() else ()):
        out_dtype = torch.promote_types(out_dtype, t.dtype)
    out = torch.empty(logits.shape, dtype=out_dtype, device=logits.device)
    if batch == 0:
        return out
    block = 4096 if logits.is_cuda else 1024
    _penalties_kernel[(batch, triton.cdiv(vocab, block))](
        logits, counts, seen.view(torch.uint8), presence.float().contiguous(), frequency.float().contiguous(),
        repetition.float().contiguous(), out, vocab, BLOCK=block, num_warps=8 if logits.is_cuda else 1)
    return out


_MASK31 = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _uniform_noise(seed, offset, idx):
    """reference._uniform_noise: 31-bit xorshift-multiply hash of (seed, offset, token), int64 math."""
    mask = _MASK31
    x = (((seed & mask) * 0x9E3779B1) & mask) ^ (((offset & mask) * 0x85EBCA77) & mask)
    x = x ^ ((idx * 0xC2B2AE3D) & mask)
    for _ in tl.static_range(3):
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & mask
        x = ((x ^ (x >> 12)) * 0x297A2D39) & mask
    x = x ^ (x >> 15)
    return (x.to(tl.float64) + 0.5) / 2147483648.0


@triton.jit
def _row_softmax_stats(row_ptr, inv_t, vocab, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of x = logit / t over a row, in one online pass."""
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    return row_max, tl.sum(total * tl.exp(m - row_max), axis=0)


@triton.jit
def _above(probs_row_ptr, t, vocab, BLOCK: tl.constexpr):
    """Over the row's probabilities: (count and mass of p > t, largest p <= t, smallest p > t)."""
    count = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    below = tl.full([BLOCK], -1.0, dtype=tl.float32)
    above = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = tl.load(probs_row_ptr + cols, mask=cols < vocab, other=-1.0)
        is_above = p > t
        count += is_above.to(tl.int32)
        mass += tl.where(is_above, p, 0.0)
        below = tl.maximum(below, tl.where(is_above, -1.0, p))
        above = tl.minimum(above, tl.where(is_above, p, float("inf")))
    return tl.sum(count, axis=0), tl.sum(mass, axis=0), tl.max(below, axis=0), tl.min(above, axis=0)


@triton.jit
def _keep_threshold_kernel(logits_ptr, temperature_ptr, top_p_ptr, top_k_ptr, probs_ptr, threshold_ptr, vocab,
                           BLOCK: tl.constexpr):
    """The reference keeps token i iff rank_i < k and (mass ranked before i) < top_p. Both sides
    only grow as p_i falls, so the kept set is {p >= tau}: tau is the smallest probability p with
    count(> p) < k and mass(> p) < top_p, found by bisection over float32 bit patterns (each step
    also snaps to the nearest probabilities, which ends the search within ~log2(V) steps). The
    threshold is handed on as the smallest kept logit."""
    b = tl.program_id(0).to(tl.int64)
    row = logits_ptr + b * vocab
    top_p = tl.load(top_p_ptr + b)
    k = tl.load(top_k_ptr + b).to(tl.int64)
    k = tl.where((k <= 0) | (k > vocab), vocab, k).to(tl.int32)
    if (k >= vocab) & (top_p >= 1.0):  # no filter on this row
        tl.store(threshold_ptr + b, float("-inf"))
    else:
        temperature = tl.load(temperature_ptr + b)
        inv_t = 1.0 / tl.where(temperature <= 0, 1.0, temperature)
        row_max, row_sum = _row_softmax_stats(row, inv_t, vocab, BLOCK)
        probs = probs_ptr + b * vocab
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(x - row_max) / row_sum
            tl.store(probs + cols, p, mask=cols < vocab)
            peak = tl.maximum(peak, p)
        hi = tl.max(peak, axis=0).to(tl.int32, bitcast=True)  # the top token is always kept
        lo = hi * 0 - 1  # below every probability: all V tokens are above it, never kept (k <= V)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            count, mass, below, above = _above(probs, mid.to(tl.float32, bitcast=True), vocab, BLOCK)
            kept = (count < k) & (mass < top_p)
            hi = tl.where(kept, below.to(tl.int32, bitcast=True), hi)  # the same tokens are above `below`
            lo = tl.where(kept, lo, tl.where(above.to(tl.int32, bitcast=True) == hi, hi - 1, mid))
        tau = hi.to(tl.float32, bitcast=True)
        smallest = tl.full([BLOCK], float("inf"), dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(probs + cols, mask=cols < vocab, other=-1.0)
            logit = tl.load(row + cols, mask=cols < vocab, other=float("inf")).to(tl.float32)
            smallest = tl.minimum(smallest, tl.where(p >= tau, logit, float("inf")))
        tl.store(threshold_ptr + b, tl.min(smallest, axis=0))


@triton.jit
def _chunk_best_kernel(logits_ptr, threshold_ptr, temperature_ptr, seeds_ptr, offsets_ptr, best_score_ptr,
                       best_index_ptr, vocab, BLOCK: tl.constexpr):
    """Best token of one vocabulary chunk and its log-score, comparable across chunks: the logit
    for greedy rows; for sampled rows x_c + log(max_i p'_i / E_i), with p'_i = exp(x_i - x_c),
    x = logit / t and x_c the chunk's top kept x (the row's softmax sum cancels in the argmax)."""
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = idx < vocab
    logit = tl.load(logits_ptr + b * vocab + idx, mask=in_vocab, other=float("-inf")).to(tl.float32)
    top_logit, top_at = tl.max(logit, axis=0, return_indices=True, return_indices_tie_break_left=True)

    temperature = tl.load(temperature_ptr + b)
    keep = in_vocab & (logit >= tl.load(threshold_ptr + b))
    x = logit * (1.0 / tl.where(temperature <= 0, 1.0, temperature))
    x_top = tl.max(tl.where(keep, x, float("-inf")), axis=0)
    p = tl.where(keep, tl.exp(x - tl.where(x_top == float("-inf"), 0.0, x_top)), 0.0)
    noise = _uniform_noise(tl.load(seeds_ptr + b).to(tl.int64), tl.load(offsets_ptr + b).to(tl.int64),
                           idx.to(tl.int64))
    # Exponential race: argmax p_i / E_i, E_i = -log(u_i) ~ Exp(1), draws i with probability p_i.
    race, race_at = tl.max(tl.where(keep, p.to(tl.float64) / -tl.log(noise), 0.0), axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
    has_race = race > 0  # a chunk may keep nothing
    race_score = tl.where(has_race, x_top.to(tl.float64) + tl.log(tl.where(has_race, race, 1.0)), float("-inf"))

    greedy = temperature <= 0
    n_chunks = tl.num_programs(1)
    tl.store(best_score_ptr + b * n_chunks + chunk, tl.where(greedy, top_logit.to(tl.float64), race_score))
    tl.store(best_index_ptr + b * n_chunks + chunk, chunk * BLOCK + tl.where(greedy, top_at, race_at))


@triton.jit
def _pick_chunk_kernel(best_score_ptr, best_index_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    score = tl.load(best_score_ptr + b * n_chunks + offs, mask=offs < n_chunks, other=float("-inf"))
    _, chunk = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + b, tl.load(best_index_ptr + b * n_chunks + chunk).to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor, *, top_filters: bool = True) -> torch.Tensor:
    """One token per row of logits [B, V] → [B] int64 (see reference.sample). `top_filters=False` is
    the caller's host-side promise that no row sets top-k or top-p, which skips the threshold search."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    threshold = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    if top_filters:  # a program per row walks the row ~20 times: wide steps, many loads in flight
        probs = torch.empty((batch, vocab), dtype=torch.float32, device=logits.device)
        block, warps = (8192, 32) if logits.is_cuda else (4096, 1)  # H200 sweep: 310 us vs 520 at (4096, 16)
        _keep_threshold_kernel[(batch,)](logits, temperature, top_p.float().contiguous(), top_k.contiguous(), probs,
                                         threshold, vocab, BLOCK=block, num_warps=warps)
    block = 4096 if logits.is_cuda else 1024  # several chunks even for the interpreter's small vocabularies
    n_chunks = triton.cdiv(vocab, block)
    best_score = torch.empty((batch, n_chunks), dtype=torch.float64, device=logits.device)
    best_index = torch.empty((batch, n_chunks), dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(batch, n_chunks)](
        logits, threshold, temperature, seeds.contiguous(), offsets.contiguous(), best_score, best_index, vocab,
        BLOCK=block, num_warps=8 if logits.is_cuda else 1)
    _pick_chunk_kernel[(batch,)](best_score, best_index, out, n_chunks,
                                 BLOCK_C=triton.next_power_of_2(n_chunks), num_warps=4)
    return out
