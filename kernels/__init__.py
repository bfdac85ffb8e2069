"""Ops used by the models. Each op picks its Triton kernel for CUDA tensors and the plain-torch
reference (kernels/reference.py) otherwise, so the same model code runs on CPU and GPU; which
kernels run and how they launch is `kernels.settings` (the `kernels` config group).

The ops are loaded on first use, so `llaunch.kernels.settings` imports without torch (the launcher
validates kernel settings).
"""
OPS = ("apply_penalties", "decode_attention", "fused_moe", "gated_linear", "gelu_tanh_mul", "greedy_tokens", "linear",
       "lm_head_linear",
       "moe_route", "prefill_attention", "qkv_rotary_store_kv", "rmsnorm", "rope_cos_sin", "rotary_embedding",
       "rotary_store_kv", "sample", "silu_mul", "store_kv")


def __getattr__(name: str):
    if name in OPS:
        from llaunch.kernels import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'llaunch.kernels' has no attribute {name!r}")
