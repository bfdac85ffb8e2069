"""Attention logit soft-capping (Gemma 2: cap · tanh(score / cap)) for the attention kernels, which
hold scores in the log2 domain (score · log2 e): capping there with cap · log2 e is the same map."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap(x, cap):
    """cap · tanh(x / cap), tanh from one exp2 of a non-positive argument (no overflow at any x)."""
    y = tl.abs(x) / cap
    e = tl.exp2(-2.8853900817779268 * y)  # e^(-2y): 2 log2(e) = 2.885...
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)
