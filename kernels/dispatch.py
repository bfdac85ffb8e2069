"""Choose, per call, between a Triton kernel (CUDA tensors) and the torch reference."""
from __future__ import annotations

import os

from llaunch.kernels import reference

_FORCE_REFERENCE = os.environ.get("LLAUNCH_KERNELS", "") == "reference"


def _use_triton(t) -> bool:
    return t.is_cuda and not _FORCE_REFERENCE


rope_cos_sin = reference.rope_cos_sin


def rmsnorm(x, weight, eps, residual=None):
    return reference.rmsnorm(x, weight, eps, residual)


def rotary_embedding(q, k, positions, cos, sin):
    return reference.rotary_embedding(q, k, positions, cos, sin)


def store_kv(k_cache, v_cache, slots, k, v):
    return reference.store_kv(k_cache, v_cache, slots, k, v)


def prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens, prefix_lens, scale):
    return reference.prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens, prefix_lens, scale)


def decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale):
    return reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale)


def silu_mul(x):
    return reference.silu_mul(x)


def apply_penalties(logits, counts, presence, frequency, repetition, seen):
    return reference.apply_penalties(logits, counts, presence, frequency, repetition, seen)


def sample(logits, temperature, top_p, top_k, seeds, offsets):
    return reference.sample(logits, temperature, top_p, top_k, seeds, offsets)
