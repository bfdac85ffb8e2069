"""The ops the models call. Each picks, per call, its Triton kernel (CUDA tensors) or the plain-torch
reference (kernels/reference.py), so the same model code runs on CPU and GPU; which kernels run and how
they launch is `kernels.settings` (the `kernels` config group). Callers import the ops from here:
kernels/ has no __init__.py (see pyproject.toml), and `llaunch.kernels.<op>` would name the op's module.

Triton is imported on the first CUDA call only, so CPU-only installs never need it and tests can
set TRITON_INTERPRET before it is imported. The keyword-only hints (max lengths, top_filters) are
host-side ints/bools that size grids or skip work without a device sync; the references ignore them.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import NamedTuple, Optional

import torch

from llaunch.kernels import fp8, int8, kv_fp8, reference, settings

_KERNEL_MODULES = ("gemv", "rmsnorm", "rotary", "store_kv", "prefill_attention", "decode_attention",
                   "gated_activation", "sampling", "greedy", "fp8_block", "fp8_rows", "fp8_epilogue", "fused_moe",
                   "skinny_gemm", "fp8_gated_quant", "int8_rows")


def _use_triton(t) -> bool:
    return t.is_cuda and not settings.current.reference


@functools.cache
def triton_ops() -> types.SimpleNamespace:
    """The Triton implementations, by op name (imports triton on first use)."""
    modules = {name: importlib.import_module(f"llaunch.kernels.{name}") for name in _KERNEL_MODULES}
    return types.SimpleNamespace(
        rmsnorm=modules["rmsnorm"].rmsnorm,
        rmsnorm_quantized=modules["rmsnorm"].rmsnorm_quantized,
        rotary_embedding=modules["rotary"].rotary_embedding,
        rotary_store_kv=modules["rotary"].rotary_store_kv,
        rotary_store_kv_fp8=modules["rotary"].rotary_store_kv_fp8,
        store_kv=modules["store_kv"].store_kv,
        prefill_attention=modules["prefill_attention"].prefill_attention,
        decode_attention=modules["decode_attention"].decode_attention,
        silu_mul=modules["gated_activation"].silu_mul,
        gelu_tanh_mul=modules["gated_activation"].gelu_tanh_mul,
        gemv=modules["gemv"].gemv,
        gemv_staged_for=modules["gemv"].staged_for,
        skinny_gemm=modules["skinny_gemm"].skinny_gemm,
        skinny_takes=modules["skinny_gemm"].takes,
        greedy_tokens=modules["greedy"].greedy_tokens,
        apply_penalties=modules["sampling"].apply_penalties,
        sample=modules["sampling"].sample,
        fp8_block_linear=modules["fp8_block"].fp8_block_linear,
        quantize_rows=modules["fp8_rows"].quantize_rows,
        fp8_epilogue=modules["fp8_epilogue"].scale_rows_and_channels,
        gated_quantize=modules["fp8_gated_quant"].gated_quantize,
        moe_route=modules["fused_moe"].moe_route,
        fused_moe=modules["fused_moe"].fused_moe,
        int8_rows_logits=modules["int8_rows"].logits,
        int8_rows_linear=modules["int8_rows"].linear,
    )


rope_cos_sin = reference.rope_cos_sin


def rmsnorm(x, weight, eps, residual=None, into=None):
    """norm(x) or, with `residual`, (norm(x + residual), x + residual). `into`: the weight of the layer the norm's
    output feeds; an fp8 layer that quantizes its input per token gets it quantized by the norm's kernel
    (QuantizedRows: kernels.fp8_fused_norm) where its own product would quantize it (2+ rows). x may be an fp8
    layer's ScaledSums (kernels.fp8_norm_epilogue): the kernel scales them before the residual add."""
    sums = None
    if isinstance(x, ScaledSums):
        if residual is not None and residual.dtype == x.dtype and x.bias is None and _use_triton(x.sums):
            x, sums = x.sums, (x.row_scales, x.channel_scales)
        else:
            x = scaled(x)
    x_dtype = x.dtype if sums is None else residual.dtype
    if isinstance(into, fp8.Fp8Weight) and _norm_quantizes(x, x_dtype, weight, residual, into):
        static = into.input_scale if into.activations == fp8.STATIC else None
        result = triton_ops().rmsnorm_quantized(x, weight, eps, residual, into.scale_ub, static, sums)
        (q, scale), h = result if residual is not None else (result, None)
        rows = QuantizedRows(q, scale, weight.dtype, tuple(x.shape[:-1]))
        return (rows, h) if residual is not None else rows
    if sums is not None:
        return triton_ops().rmsnorm(x, weight, eps, residual, sums)
    if _use_triton(x):
        return triton_ops().rmsnorm(x, weight, eps, residual)
    return reference.rmsnorm(x, weight, eps, residual)


def _norm_quantizes(x, x_dtype, weight, residual, into) -> bool:
    """Whether the norm quantizes for `into`: a per-token-quantized fp8 layer whose input would otherwise go
    through quantize_rows (not the one-row GEMV, which quantizes as it reads), in the norm weight's dtype."""
    dtype = torch.promote_types(x_dtype if residual is None else torch.promote_types(x_dtype, residual.dtype),
                                weight.dtype)
    return (settings.current.fp8_fused_norm and _use_triton(x) and _per_channel_quantized(into)
            and not _fp8_row(x, into) and dtype == weight.dtype)


def rows_of(x) -> int:
    """The tokens of a layer's input, a tensor or QuantizedRows."""
    return x.q.shape[0] if isinstance(x, QuantizedRows) else x.shape[0]


def _partial(q, cos) -> bool:
    """Tables narrower than the head: rotary on its leading 2 x cos.shape[-1] dims only (partial_rotary_factor)."""
    return 2 * cos.shape[-1] < q.shape[-1]


def rotary_embedding(q, k, positions, cos, sin):
    """Rotate-half rotary on q [T, Hq, D] and k [T, Hk, D]; tables [P, R/2] rotate each head's first R dims (the
    rest pass through: Phi-4-mini's partial rotary)."""
    if _use_triton(q):
        if _partial(q, cos):  # the kernel rotates the leading dims (a strided view), the rest is copied beside
            r = 2 * cos.shape[-1]
            q_rot, k_rot = triton_ops().rotary_embedding(q[..., :r], k[..., :r], positions, cos, sin)
            return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        return triton_ops().rotary_embedding(q, k, positions, cos, sin)
    return reference.rotary_embedding(q, k, positions, cos, sin)


def rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, kv_scales=None, with_kv=False,
                    q_norm=None, k_norm=None, eps=0.0):
    """The rotated q; with_kv: (q, k, v) with an fp8 cache's unrounded rotated k and v (prefill reads them).
    q_norm / k_norm: each head RMSNorm'd first (Qwen3, Gemma 3), in the rotary kernel where it can."""
    fused = _use_triton(q) and kv_scales is None and not _partial(q, cos) and k_cache.dtype == k.dtype
    # an fp8 cache's store in the rotary kernel too, but while calibrating (the absmax of what is stored)
    fused_fp8 = (_use_triton(q) and kv_scales is not None and kv_scales.k_amax is None and not _partial(q, cos)
                 and k.dtype == v.dtype)
    if q_norm is not None and not (fused or fused_fp8):
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
        q_norm = k_norm = None
    if fused_fp8:  # the chunk's own K/V for prefill attention: k rotated, v as projected (both unrounded)
        q, k = triton_ops().rotary_store_kv_fp8(q, k, v, positions, cos, sin, k_cache, v_cache, slots, kv_scales.k,
                                                kv_scales.v, q_norm, k_norm, eps, with_k=with_kv)
        return (q, k, v) if with_kv else q
    if kv_scales is not None:  # an fp8 cache (kernels/kv_fp8.py): quantized on store
        q, k = rotary_embedding(q, k, positions, cos, sin)
        kv_fp8.store_kv(k_cache, v_cache, slots, k, v, kv_scales)
        return (q, k, v) if with_kv else q
    if with_kv:
        return rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, q_norm=q_norm, k_norm=k_norm,
                               eps=eps), None, None
    if _use_triton(q) and _partial(q, cos):
        q, k = rotary_embedding(q, k, positions, cos, sin)
        store_kv(k_cache, v_cache, slots, k, v)
        return q
    if _use_triton(q) and k_cache.dtype == k.dtype:
        return triton_ops().rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, q_norm, k_norm,
                                            eps)
    return reference.rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)


def store_kv(k_cache, v_cache, slots, k, v):
    if _use_triton(k):
        return triton_ops().store_kv(k_cache, v_cache, slots, k, v)
    return reference.store_kv(k_cache, v_cache, slots, k, v)


def _scales(kv_scales, new_kv=(None, None)) -> dict:
    if kv_scales is None:
        return {}
    fresh = {} if new_kv[0] is None else {"k_new": new_kv[0], "v_new": new_kv[1]}
    return {"k_scale": kv_scales.k, "v_scale": kv_scales.v, **fresh}


def prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens, prefix_lens, scale,
                      *, max_q_len: Optional[int] = None, kv_scales=None, new_kv=(None, None), window: int = 0,
                      softcap: float = 0.0, out=None):
    """new_kv: an fp8 cache's chunk K/V unrounded ([T, Hk, D] each, as q): the chunk attends itself
    through them and only its prefix through the fp8 cache (SGLang's extend attention does so too:
    the rounding of the nearby tokens is what costs top-1 agreement, tests/unit/test_fp8_kv.py).
    window > 0: a sliding-window layer (each query sees its last `window` positions); softcap > 0:
    Gemma 2's attention logit soft-capping. out: [T, Hq, D] the result is written into (rows no chunk covers
    keep their values on a GPU)."""
    if _use_triton(q):  # an fp8 cache (kv_scales) is dequantized as the kernel loads it
        return triton_ops().prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens,
                                              prefix_lens, scale, max_q_len=max_q_len, window=window,
                                              softcap=softcap, out=out, **_scales(kv_scales, new_kv))
    if kv_scales is not None:  # the reference reads an fp8 cache dequantized
        k_cache = kv_fp8.Dequantizing(k_cache, kv_scales.k, q.dtype)
        v_cache = kv_fp8.Dequantizing(v_cache, kv_scales.v, q.dtype)
    else:
        new_kv = (None, None)
    return _into(out, reference.prefill_attention(q, k_cache, v_cache, req_to_slots, rows, q_starts, q_lens,
                                                  prefix_lens, scale, *new_kv, window=window, softcap=softcap))


def _into(out, result):
    return result if out is None else out.copy_(result)


def decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale, *, max_len: Optional[int] = None,
                     kv_scales=None, window: int = 0, softcap: float = 0.0, out=None):
    if _use_triton(q):
        return triton_ops().decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale,
                                             max_len=max_len, window=window, softcap=softcap, out=out,
                                             **_scales(kv_scales))
    if kv_scales is not None:
        k_cache = kv_fp8.Dequantizing(k_cache, kv_scales.k, q.dtype)
        v_cache = kv_fp8.Dequantizing(v_cache, kv_scales.v, q.dtype)
    return _into(out, reference.decode_attention(q, k_cache, v_cache, req_to_slots, rows, seq_lens, scale,
                                                 window=window, softcap=softcap))


def _one_row(x) -> bool:
    # Batch-1 decode reads every weight for one row: the GEMV kernel; wider inputs go to cuBLAS.
    return settings.current.triton_gemv and _use_triton(x) and x.dim() == 2 and x.shape[0] == 1


def _invariant_rows(x, weight) -> bool:
    # kernels.row_invariant: a small step's rows of a 16-bit layer each on the GEMV's one-row code (its row grid)
    return (x.dim() == 2 and settings.invariant_step(x.shape[0]) and settings.current.triton_gemv and _use_triton(x)
            and isinstance(weight, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype)


def _few_rows(x, weight) -> bool:
    # 2..kernels.skinny_rows rows (a verify step, a small decode batch): one pass over the weights on the tensor cores
    return settings.current.settings.skinny_rows >= 2 and _use_triton(x) and triton_ops().skinny_takes(x, weight)


def _fp8_row(x, weight: "fp8.Fp8Weight") -> bool:
    """A one-row step (batch-1 decode) with per-channel e4m3 weights: the GEMV, which quantizes the row as it
    reads it (cuBLASLt's GEMM needs the row quantized by kernels of its own: ~8 small kernels a layer)."""
    return _one_row(x) and weight.block is None


def _quantize_rows(x, weight: "fp8.Fp8Weight"):
    """An fp8 layer's activations per token in one Triton kernel (fp8.quantize_activations' roundings)."""
    static = weight.input_scale if weight.activations == fp8.STATIC else None
    return triton_ops().quantize_rows(x.contiguous(), weight.scale_ub, static)


class QuantizedRows(NamedTuple):
    """An fp8 layer's input already in e4m3, one scale a token: what gated_linear hands down_proj when it
    quantizes in the activation's kernel (kernels/fp8_gated_quant.py)."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the model's: the layer's output
    lead: tuple  # the activation's leading dims ([M] flattened)


class ScaledSums(NamedTuple):
    """An fp8 layer's output left to the kernel after it to scale (kernels.fp8_norm_epilogue): cuBLASLt's per-tensor
    GEMM's bfloat16 sums with the token and channel scales (and bias) kernels/fp8_epilogue.py would apply. What a
    layer called with unscaled=True may return; rmsnorm (with a residual), qkv_rotary_store_kv's rotary kernel and
    `scaled` take it."""

    sums: torch.Tensor  # [*lead, N] bfloat16
    row_scales: torch.Tensor  # [M, 1] float32
    channel_scales: torch.Tensor  # [N] float32
    bias: Optional[torch.Tensor]  # [N] in dtype, added after the scales
    dtype: torch.dtype  # the model's: the layer's output


def scaled(x):
    """A layer's output as a tensor: ScaledSums through the epilogue kernel, anything else as it is."""
    if not isinstance(x, ScaledSums):
        return x
    y = x.sums.reshape(-1, x.sums.shape[-1])
    return triton_ops().fp8_epilogue(y, x.row_scales, x.channel_scales, x.bias, x.dtype).reshape(x.sums.shape)


def _epilogue():
    """kernels.fp8_gemm: the epilogue kernel, or None (the row-wise GEMM)."""
    return triton_ops().fp8_epilogue if settings.current.fp8_epilogue else None


def fp8_linear(x, weight: "fp8.Fp8Weight", bias=None, unscaled: bool = False):
    """An fp8 layer (kernels/fp8.py): on a GPU cuBLASLt's scaled GEMM, or for block-wise weights the
    Triton block GEMM (kernels/fp8_block.py), or for one row the GEMV; their roundings in torch elsewhere.
    x may come quantized (QuantizedRows, the fused MLP's down_proj input). unscaled: the caller hands the output to
    the next RMSNorm, so the per-tensor GEMM's sums may come back as ScaledSums for it to scale."""
    if isinstance(x, QuantizedRows):
        return _product(x.q, x.scale, weight, bias, x.dtype, x.lead, unscaled)
    if _fp8_row(x, weight):
        return triton_ops().gemv(x, weight, bias)
    if _use_triton(x):
        if weight.block is not None and weight.activations != fp8.NONE:
            return triton_ops().fp8_block_linear(x, weight, bias)
        if weight.activations != fp8.NONE:
            q, scale = _quantize_rows(x.reshape(-1, x.shape[-1]), weight)
            return _product(q, scale, weight, bias, x.dtype, tuple(x.shape[:-1]), unscaled)
        return fp8.scaled_mm_linear(x, weight, bias)  # weight-only: dequantized, the model dtype's GEMM
    return fp8.reference_linear(x, weight, bias)


def _product(q, scale, weight: "fp8.Fp8Weight", bias, dtype, lead: tuple, unscaled: bool):
    """The GEMM of e4m3 rows (q [M, K], scale [M, 1]) → [*lead, N] in dtype, or the per-tensor GEMM's ScaledSums
    where the caller takes them and kernels.fp8_norm_epilogue is on, for a 16-bit model (in float32 the epilogue's
    product and bias add contract to one FMA where the norm's and rotary's round between: not the same bytes)."""
    if (unscaled and settings.current.fp8_epilogue and settings.current.fp8_norm_epilogue
            and dtype in (torch.bfloat16, torch.float16)):
        y = fp8.scaled_mm_sums(q, scale, weight, rowwise=False)
        return ScaledSums(y.reshape(*lead, y.shape[-1]), scale, weight.scale, bias, dtype)
    return fp8.scaled_mm_rows(q, scale, weight, bias, dtype, lead, _epilogue())


def _per_channel_quantized(w) -> bool:
    return isinstance(w, fp8.Fp8Weight) and w.block is None and w.activations != fp8.NONE


def _fused_mlp(x, weight, down) -> bool:
    """An fp8 gate‖up of 2+ rows on a GPU whose down_proj quantizes its input per token: one kernel from the
    sums to down_proj's e4m3 (kernels.fp8_fused_mlp)."""
    return (settings.current.fp8_fused_mlp and _use_triton(x) and _per_channel_quantized(weight)
            and _per_channel_quantized(down))


def _gated_quantized(x, weight: "fp8.Fp8Weight", down: "fp8.Fp8Weight") -> QuantizedRows:
    """gate‖up's fp8 GEMM, then act · up quantized for `down` as fp8_linear(silu_mul(...), down) would (the same
    e4m3 values and scales: tests/kernels/test_kernel_fp8_gated_quant.py). x: a tensor or QuantizedRows."""
    if isinstance(x, QuantizedRows):
        q, scale, dtype, lead = x
    else:
        q, scale = _quantize_rows(x.reshape(-1, x.shape[-1]), weight)
        dtype, lead = x.dtype, tuple(x.shape[:-1])
    rowwise = not settings.current.fp8_epilogue
    y = fp8.scaled_mm_sums(q, scale, weight, rowwise)
    rows, channels = (None, None) if rowwise else (scale, weight.scale)  # unscaled sums: the kernel applies them
    static = down.input_scale if down.activations == fp8.STATIC else None
    q2, s2 = triton_ops().gated_quantize(y, dtype, rows, channels, down.scale_ub, static)
    return QuantizedRows(q2, s2, dtype, lead)


def linear(x, weight, bias=None, unscaled: bool = False):
    """x Wᵀ + b. unscaled: the caller hands the output to a kernel that takes an fp8 layer's ScaledSums (fp8_linear):
    the next RMSNorm with the residual, or qkv_rotary_store_kv's rotary; a 16-bit layer's output is a tensor."""
    if isinstance(weight, fp8.Fp8Weight):
        return fp8_linear(x, weight, bias, unscaled)
    if isinstance(weight, int8.Int8Rows):
        return int8_linear(x, weight, bias)
    if _one_row(x) or _invariant_rows(x, weight):
        return triton_ops().gemv(x, weight, bias)
    if _few_rows(x, weight):
        return triton_ops().skinny_gemm(x, weight, bias)
    return reference.linear(x, weight, bias)


def int8_linear(x, weight: "int8.Int8Rows", bias=None):
    """A model.quantization=int8 layer: kernels/int8_rows.py at every row count (x's dtype), kernels/int8.py's
    reference on CPU."""
    if not _use_triton(x):
        return int8.reference_linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return triton_ops().int8_rows_linear(flat, weight, bias).reshape(*x.shape[:-1], weight.weight.shape[0])


def lm_head_linear(x, weight):
    """The LM head: for one row on a GPU the staged GEMV where gemv.staged_for says so (by default a
    vocabulary-sized weight on Hopper: 0.237 ms for Qwen2-7B's against cuBLAS's 0.248), else cuBLAS.
    kernels.gemv_shapes with STAGES 0 for the LM head's shape keeps it on cuBLAS. The logits come in
    x's dtype or, from the staged GEMV, already in float32 (same values, bf16-rounded as cuBLAS +
    .float(): no cast kernel after it in the decode graph). 2..kernels.skinny_rows rows (a verify step): the skinny
    GEMM (kernels/skinny_gemm.py), in x's dtype. Under kernels.row_invariant a step of up to 16 rows: the GEMV's
    register kernel, each row alike (float32 logits). An e4m3 head (model.fp8_lm_head) is an fp8 layer: the fp8 GEMV at
    one row (float32 logits, as the staged GEMV's), the fp8 GEMMs at more (logits in x's dtype). An int8 head
    (model.int8_lm_head): kernels/int8_rows.py at every row count (float32 logits), kernels/int8.py's reference on CPU."""
    if isinstance(weight, int8.Int8Rows):
        flat = x.reshape(-1, x.shape[-1])
        out = triton_ops().int8_rows_logits(flat, weight) if _use_triton(x) else int8.reference_logits(flat, weight)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if isinstance(weight, fp8.Fp8Weight):
        return triton_ops().gemv(x, weight, out_dtype=torch.float32) if _fp8_row(x, weight) else fp8_linear(x, weight)
    if _invariant_rows(x, weight):
        return triton_ops().gemv(x, weight, out_dtype=torch.float32)
    if _one_row(x) and triton_ops().gemv_staged_for(weight):
        return triton_ops().gemv(x, weight, out_dtype=torch.float32)
    if _few_rows(x, weight):
        return triton_ops().skinny_gemm(x, weight)
    return reference.linear(x, weight)


def gated_linear(x, weight, down=None):
    """silu(x·gate) · (x·up) of the fused gate‖up weight; `down`: the layer after it (down_proj's weight), which an
    fp8 MLP's fused kernel quantizes for (the result is then QuantizedRows, which only that layer takes). x may come
    quantized for gate‖up (QuantizedRows, from the norm before it)."""
    if isinstance(x, QuantizedRows):
        return _gated_quantized(x, weight, down) if _fused_mlp(x.q, weight, down) else silu_mul(fp8_linear(x, weight))
    if isinstance(weight, int8.Int8Rows):  # the product whole, then the activation (no fused int8 kernel)
        return silu_mul(int8_linear(x, weight))
    if isinstance(weight, fp8.Fp8Weight):
        if _fp8_row(x, weight):
            return triton_ops().gemv(x, weight, gated=True)
        if _fused_mlp(x, weight, down):
            return _gated_quantized(x, weight, down)
        return silu_mul(fp8_linear(x, weight))
    if _one_row(x) or _invariant_rows(x, weight):
        return triton_ops().gemv(x, weight, gated=True)
    if _few_rows(x, weight):
        return triton_ops().skinny_gemm(x, weight, gated=True)
    return silu_mul(reference.linear(x, weight))


def qkv_rotary_store_kv(x, weight, bias, n_q_heads: int, n_kv_heads: int, positions, cos, sin, k_cache, v_cache,
                        slots, kv_scales=None, with_kv=False):
    """The attention block's input half: x through the fused q‖k‖v weight, rotary on q and k, k and v
    stored at each token's slot; returns the rotated q [T, Hq, D] (with_kv: q, k, v, rotary_store_kv). (Rotary in the qkv GEMV's epilogue,
    one kernel, measured 1–12 µs a step slower than these two under PDL, and was removed.)"""
    d = k_cache.shape[-1]
    t = rows_of(x)

    def heads(y):  # q [T, Hq, D], k and v [T, Hk, D]: views of the projection's columns
        return (part.view(t, n, d) for part, n in zip(y.split([n_q_heads * d, n_kv_heads * d, n_kv_heads * d], -1),
                                                      (n_q_heads, n_kv_heads, n_kv_heads)))

    y = linear(x, weight, bias, unscaled=True)
    if isinstance(y, ScaledSums):
        q, k, v = heads(y.sums)
        # the rotary kernel scales the sums as it reads them, into a cache of the model's dtype, rotating whole heads
        if kv_scales is None and k_cache.dtype == y.dtype and _use_triton(q) and not _partial(q, cos):
            q = triton_ops().rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots,
                                             sums=(y.row_scales, y.channel_scales, y.bias, y.dtype))
            return (q, None, None) if with_kv else q
        y = scaled(y)
    q, k, v = heads(y)
    return rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, kv_scales, with_kv)


def silu_mul(x):
    if _use_triton(x):
        return triton_ops().silu_mul(x)
    return reference.silu_mul(x)


def gelu_tanh_mul(x):
    """GeGLU (Gemma): [.., 2I] (gate ‖ up) → gelu_tanh(gate) * up."""
    if _use_triton(x):
        return triton_ops().gelu_tanh_mul(x)
    return reference.gelu_tanh_mul(x)


def moe_route(router_logits, top_k: int, renormalize: bool):
    """(weights [T, k] float32, experts [T, k] int32): the top-k of each token's router softmax."""
    if _use_triton(router_logits):
        return triton_ops().moe_route(router_logits, top_k, renormalize)
    return reference.moe_route(router_logits, top_k, renormalize)


def fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start: Optional[int] = None):
    """The routed experts' SiLU-gated MLPs, weighted and summed per token (kernels/fused_moe.py)."""
    if _use_triton(x):
        return triton_ops().fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)
    return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)


def greedy_tokens(logits, rows, last_token):
    """Each row's argmax (the first on ties), written to last_token[rows] too: a decode graph's end
    (kernels/greedy.py's two kernels on a GPU: 9 µs less than torch.argmax + an index write at batch 1)."""
    if _use_triton(logits):
        return triton_ops().greedy_tokens(logits, rows, last_token)
    return reference.greedy_tokens(logits, rows, last_token)


def apply_penalties(logits, counts, presence, frequency, repetition, seen):
    if _use_triton(logits):
        return triton_ops().apply_penalties(logits, counts, presence, frequency, repetition, seen)
    return reference.apply_penalties(logits, counts, presence, frequency, repetition, seen)


def sample(logits, temperature, top_p, top_k, seeds, offsets, *, top_filters: bool = True):
    if _use_triton(logits):
        return triton_ops().sample(logits, temperature, top_p, top_k, seeds, offsets, top_filters=top_filters)
    return reference.sample(logits, temperature, top_p, top_k, seeds, offsets)
