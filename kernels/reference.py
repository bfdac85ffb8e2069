"""Plain-torch versions of every op the models use: what runs on CPU, and the oracle for the Triton
kernels. Written for clarity, not speed.

KV cache layout (LightLLM's token-granular slots): k_cache / v_cache are [num_slots, kv_heads,
head_dim]; `req_to_slots` is [max_rows, max_model_len] int32, row r holding the slots of request r's
tokens in position order.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm over the last dim. With `residual`: h = x + residual; returns (norm(h), h)."""
    if residual is not None:
        x = x + residual
        h = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return (out, h) if residual is not None else out


def _default_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3_inv_freq(theta, dim, s, device=None) -> torch.Tensor:
    inv_freq = _default_inv_freq(theta, dim, device)
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_inv_freq(theta, dim, s, max_position_embeddings, device=None) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters, step for step (the same float32 roundings)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _dynamic_inv_freq(theta, dim, factor, trained, lengths: Optional[torch.Tensor], device=None) -> torch.Tensor:
    """transformers' _compute_dynamic_ntk_parameters: lengths None gives the load-time frequencies [dim/2]
    (its base in float64); else a row per sequence length past `trained` [n, dim/2], as a forward pass
    that grows the length computes them (its base a float32 tensor)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    if lengths is None:
        base = theta * ((factor * trained / trained) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents)
    x = (factor * lengths / trained) - (factor - 1)
    # a strided view keeps torch on its element-by-element pow, which one 0-dim length takes in
    # transformers (its vectorized pow differs in the last bit)
    x = torch.stack([x, x], 1)[:, 0]
    base = theta * x ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponents[None, :])


def _longrope_inv_freq(theta, dim, ext_factors, device=None) -> torch.Tensor:
    ext = torch.tensor(ext_factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _longrope_attention(s, max_position_embeddings) -> float:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: Optional[dict] = None,
                 device=None, max_position_embeddings: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim // 2] in float32 (times YaRN's / LongRoPE's attention
    factor), with rope scaling (linear, llama3, yarn, dynamic, longrope) computed as transformers'
    ROPE_INIT_FUNCTIONS do, so a position's angle is the one the checkpoint's reference implementation
    uses (the model rounds the tables to its dtype, as transformers does too).

    Dynamic NTK and LongRoPE change their frequencies with the sequence's length: transformers
    recomputes them for a forward pass whose positions reach past the trained length (dynamic: past
    max_position_embeddings, to the length's; LongRoPE: past original_max_position_embeddings, its long
    factors), and cached keys keep the rotation they got. Row p holds what a token at position p gets
    when it is the pass's last position, as in transformers' token-by-token decoding: greedy output
    equals transformers' generate whenever the prompt fits the trained length. (transformers rotates a
    longer prompt, prefilled at once, wholly with its length's frequencies; here each position keeps its
    own, so a cached prefix and a chunked prefill rotate as one whole prefill does.)"""
    s = scaling or {}
    kind = s.get("rope_type", s.get("type")) or "default"
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    attention = 1.0
    if kind == "dynamic":
        trained, factor = max_position_embeddings, s["factor"]
        grown = torch.arange(trained + 1, max_positions + 1, device=device)  # row p: length p + 1
        inv_freq = torch.cat([_dynamic_inv_freq(theta, head_dim, factor, trained, None, device)
                              .expand(min(trained, max_positions), -1),
                              _dynamic_inv_freq(theta, head_dim, factor, trained, grown, device)])
    elif kind == "longrope":
        original = s["original_max_position_embeddings"]
        short = _longrope_inv_freq(theta, head_dim, s["short_factor"], device)
        long = _longrope_inv_freq(theta, head_dim, s["long_factor"], device)
        inv_freq = torch.where((positions >= original)[:, None], long, short)
        attention = _longrope_attention(s, max_position_embeddings)
    elif kind == "yarn":
        inv_freq, attention = _yarn_inv_freq(theta, head_dim, s, max_position_embeddings, device)
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(theta, head_dim, s, device)
    elif kind == "linear":
        inv_freq = _default_inv_freq(theta, head_dim, device) / float(s["factor"])
    elif kind == "default":
        inv_freq = _default_inv_freq(theta, head_dim, device)
    else:
        raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn, dynamic, "
                         "longrope)")
    freqs = positions[:, None] * inv_freq if inv_freq.dim() == 2 else torch.outer(positions, inv_freq)
    if attention == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * attention, freqs.sin() * attention


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX) rotary embedding, as Llama and Qwen2 use in Hugging Face checkpoints.
    q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns new tensors. Each product and the sum are
    rounded to q's dtype, as transformers' `q * cos + rotate_half(q) * sin` in that dtype does. Tables
    [P, R/2] with R < D rotate each head's first R dims and pass the rest (Phi-3's partial_rotary_factor)."""

    def rotate(x):
        half = cos.shape[-1]
        c = cos[positions].unsqueeze(1).float()
        s = sin[positions].unsqueeze(1).float()
        x1, x2 = x[..., :half].float(), x[..., half: 2 * half].float()
        r = lambda t: t.to(x.dtype).float()  # noqa: E731
        rotated = torch.cat([r(x1 * c) - r(x2 * s), r(x2 * c) + r(x1 * s)], dim=-1).to(x.dtype)
        return torch.cat([rotated, x[..., 2 * half:]], dim=-1) if 2 * half < x.shape[-1] else rotated

    return rotate(q), rotate(k)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write new keys/values [T, Hk, D] into their cache slots [T]."""
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rotary_embedding of q and k, store_kv of the rotated k and v; returns the rotated q."""
    q, k = rotary_embedding(q, k, positions, cos, sin)
    store_kv(k_cache, v_cache, slots, k, v)
    return q


def softcap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping: softcap · tanh(score / softcap); 0: none."""
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _attend(q, keys, values, scale, causal_offset: Optional[int], window: int = 0, softcap: float = 0.0):
    """q [Lq, Hq, D], keys/values [Lk, Hk, D] → [Lq, Hq, D]; grouped heads share a KV head. Query i sits at
    position causal_offset + i and sees keys up to it, within the last `window` positions when window > 0."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).float()
    values = values.repeat_interleave(group, dim=1).float()
    scores = softcap_scores(torch.einsum("qhd,khd->hqk", q.float(), keys) * scale, softcap)
    if causal_offset is not None:
        lq, lk = q.shape[0], keys.shape[0]
        key_pos = torch.arange(lk, device=q.device)[None, :]
        q_pos = torch.arange(lq, device=q.device)[:, None] + causal_offset
        mask = key_pos > q_pos
        if window > 0:
            mask |= key_pos <= q_pos - window
        scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      req_to_slots: torch.Tensor, rows: torch.Tensor, q_starts: torch.Tensor,
                      q_lens: torch.Tensor, prefix_lens: torch.Tensor, scale: float,
                      k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None,
                      window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention for chunks of new tokens. Sequence i owns q[q_starts[i] : q_starts[i]+q_lens[i]]
    at positions prefix_lens[i]..; it attends to its first prefix_lens[i] + q_lens[i] cached tokens
    (the new ones must already be stored). q: [T, Hq, D] → [T, Hq, D]. With k_new, v_new ([T, Hk, D],
    indexed as q) the chunk's own keys and values are read from them, only the prefix from the cache
    (an fp8 cache: the chunk attends itself unrounded, kernels/kv_fp8.py). window > 0: the query at
    position p sees positions p - window + 1 .. p only (transformers' sliding-window mask); softcap > 0:
    scores soft-capped (softcap_scores)."""
    out = torch.empty_like(q)
    for i in range(rows.shape[0]):
        s, n, p = int(q_starts[i]), int(q_lens[i]), int(prefix_lens[i])
        slots = req_to_slots[rows[i], : p + n].long()
        keys, values = k_cache[slots], v_cache[slots]
        if k_new is not None:
            keys = torch.cat([keys[:p], k_new[s : s + n].to(keys.dtype)])
            values = torch.cat([values[:p], v_new[s : s + n].to(values.dtype)])
        out[s : s + n] = _attend(q[s : s + n], keys, values, scale, causal_offset=p, window=window, softcap=softcap)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_slots: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] attends to the first seq_lens[b] cached tokens of
    row rows[b] (its own token included), the last `window` of them when window > 0; a row of length 0
    (padding) gives zeros. → [B, Hq, D]. softcap > 0: scores soft-capped (softcap_scores).
    Sequences are padded to the longest and masked, a chunk of rows at a time (one batched product
    instead of a Python loop per sequence: the CPU path's decode cost)."""
    out = torch.empty_like(q)
    batch, q_heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    for start in range(0, batch, 64):
        sl = slice(start, min(start + 64, batch))
        lens = seq_lens[sl].long()
        n = lens.shape[0]
        longest = int(lens.max()) if n else 0
        slots = req_to_slots[rows[sl].long(), :longest].long()  # [n, L]
        keys, values = k_cache[slots].float(), v_cache[slots].float()  # [n, L, Hk, D]
        qg = q[sl].float().view(n, kv_heads, q_heads // kv_heads, dim)  # q head h reads kv head h // group
        scores = softcap_scores(torch.einsum("nhgd,nlhd->nhgl", qg, keys) * scale, softcap)
        key_pos = torch.arange(longest, device=q.device)[None, :]
        pad = key_pos >= lens[:, None]
        if window > 0:
            pad |= key_pos < lens[:, None] - window
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        values = values.masked_fill(pad[:, :, None, None], 0.0)  # padding slots may hold anything, NaN too
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-padding rows: zeros
        out[sl] = torch.einsum("nhgl,nlhd->nhgd", probs, values).reshape(n, q_heads, dim).to(q.dtype)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x gateᵀ) * (x upᵀ) for a fused gate‖up weight [2I, K]."""
    return silu_mul(torch.nn.functional.linear(x, weight))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate ‖ up) → silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.float()).to(x.dtype) * up


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate ‖ up) → gelu_tanh(gate) * up, [T, I]: Gemma's GeGLU (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate.float(), approximate="tanh").to(x.dtype) * up


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts from its router logits [T, E]: the top_k of their float32 softmax, renormalized to sum
    to 1 where the model says so (Qwen's norm_topk_prob; Mixtral always). → (weights [T, k] float32, experts [T, k]
    int32), in descending weight."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts.to(torch.int32)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: Optional[int] = None) -> torch.Tensor:
    """The routed experts' MLPs: token t goes through experts topk_ids[t] with weights topk_weights[t]. x [T, H];
    w13 [E_local, 2I, H] (each expert's gate rows, then its up rows) and w2 [E_local, H, I] hold every expert
    (expert_start None) or, expert parallel, experts expert_start .. expert_start + E_local - 1 of the ids (an
    expert another rank holds adds nothing here). Each expert's
    gate‖up product, silu_mul, down product and weighted row are rounded to x's dtype (as transformers' expert
    loop); a token's k rows are summed in float32. → [T, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == (expert_start or 0) + e)
        if token.numel() == 0:
            continue
        y = linear(silu_mul(linear(x[token], w13[e])), w2[e])
        out.index_add_(0, token, (y.float() * topk_weights[token, slot, None].float()).to(x.dtype).float())
    return out.to(x.dtype)


def greedy_tokens(logits: torch.Tensor, rows: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties), also recorded as last_token[rows]."""
    tokens = torch.argmax(logits, dim=-1)
    last_token[rows] = tokens
    return tokens


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """OpenAI presence/frequency penalties over generated-token counts [B, V], and the repetition
    penalty (Hugging Face's: divide positive logits, multiply negative ones) over every token seen
    in prompt or output (`seen` [B, V] bool). Per-row penalty values [B]. Returns new logits."""
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen, penalized, logits)


def _uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniform noise in (0, 1): a hash of (seed, offset, token id). Depends only on the
    request's own seed and step, so a seeded request samples the same tokens in any batch."""
    mask = (1 << 31) - 1
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    x = (((seeds[:, None] & mask) * 0x9E3779B1) & mask) ^ (((offsets[:, None] & mask) * 0x85EBCA77) & mask)
    x = x ^ ((idx * 0xC2B2AE3D) & mask)
    for _ in range(3):  # xorshift-multiply rounds on 31 bits (int64 arithmetic never overflows)
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & mask
        x = ((x ^ (x >> 12)) * 0x297A2D39) & mask
    x = x ^ (x >> 15)
    return (x.to(torch.float64) + 0.5) / float(mask + 1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One token per row from logits [B, V] (float32). temperature <= 0 means greedy; top_k <= 0 or
    >= V means no top-k; seeds/offsets [B] int64 make the draw reproducible. → [B] int64."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    cum_before = sorted_p.cumsum(-1) - sorted_p
    keep = (rank < k[:, None]) & (cum_before < top_p[:, None])
    keep[:, 0] = True
    sorted_p = sorted_p.masked_fill(~keep, 0.0)
    # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
    exp_noise = -torch.log(_uniform_noise(seeds, offsets, vocab))
    noise_sorted = torch.gather(exp_noise, 1, order)
    choice = torch.argmax(sorted_p.double() / noise_sorted, dim=-1)
    sampled = torch.gather(order, 1, choice[:, None]).squeeze(1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
