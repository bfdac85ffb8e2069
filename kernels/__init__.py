"""Ops used by the models. Each op picks its Triton kernel for CUDA tensors and the plain-torch
reference (kernels/reference.py) otherwise, so the same model code runs on CPU and GPU.

`LLAUNCH_KERNELS=reference` forces the references everywhere (debugging, A/B timing).
"""
from llaunch.kernels.dispatch import (  # noqa: F401
    apply_penalties,
    decode_attention,
    gated_linear,
    greedy_tokens,
    linear,
    lm_head_linear,
    prefill_attention,
    qkv_rotary_store_kv,
    rmsnorm,
    rope_cos_sin,
    rotary_embedding,
    rotary_store_kv,
    sample,
    silu_mul,
    store_kv,
)
