"""e4m3 rounding inside Triton kernels: a float32 value divided by its scale, saturated at ±448 and rounded to
the nearest e4m3 value (kernels/fp8.to_fp8's roundings), for the kernels that quantize activations as they
read them (kernels/fp8_block.py, the fp8 GEMV's row)."""
from __future__ import annotations

import triton
import triton.language as tl

from llaunch.kernels.fp8 import FP8_MAX, MIN_SCALE

FP8_MAX_C, MIN_SCALE_C = tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)  # what kernels may read of kernels/fp8.py


@triton.jit
def round_to_e4m3(y):
    """y (float32, within ±448) rounded to the nearest e4m3 value, ties to even, still in float32.
    Only under the interpreter: its float32 → fp8 cast lets a mantissa that rounds up carry into
    the wrong bit (31.2 becomes 16), so it is given values it need not round."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 steps by 2^-9, float32's ulp at 24576; the sign bit is kept (-0 and what rounds to it)
    subnormal = (tl.abs(y) + 24576.0) - 24576.0
    subnormal = tl.where(y.to(tl.int32, bitcast=True) < 0, -subnormal, subnormal)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def scale_of_absmax(amax):
    """A row's (or group's) activation scale from its absmax: absmax / 448, floored (kernels/fp8.token_scales)."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX_C), MIN_SCALE_C)


@triton.jit
def quantized(x, scale, INTERPRETED: tl.constexpr):
    """x / scale saturated at ±448, rounded to e4m3, as float32 (the value an fp8 GEMM multiplies)."""
    y = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C)
    if INTERPRETED:
        return round_to_e4m3(y)
    return y.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def quotient_rn(x, scale, rcp):
    """x / scale as div.rn's fast path computes it: the product with rcp = div_rn(1, scale) (taken once for many x),
    then one FMA correction (Markstein's). Neither that product nor the remainder is always exact, yet the corrected
    quotient was the correctly rounded one wherever the remainder does not underflow (quotients below ~1e-29 may be
    off, all of them e4m3's ±0). Two instructions a value where div.rn takes a reciprocal, a range check and a
    branch. A zero x gives +0 (div.rn keeps -0's sign)."""
    q = x * rcp
    return tl.fma(tl.fma(-q, scale, x), rcp, q)


@triton.jit
def e4m3_of(x, scale, OWN_SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x / scale rounded to e4m3 (kernels/fp8.to_fp8's bytes). OWN_SCALE: scale is x's row's absmax / 448 (floored),
    so no quotient leaves ±448·(1 + 2^-23): the quotient by quotient_rn through the row's reciprocal (one division a
    row where the compiler sees one scale), the sign of a zero kept, and the conversion's saturation for the clamp
    (an sm_90 build of the gated quantize: 40 instructions a value against 53 dividing). Its e4m3 bytes were the
    division's for every bfloat16 and float16 x by every scale of that kind (2.1e9 pairs, emulated exactly,
    2026-12-06); a row holding ±inf (scale inf) makes its finite values NaN where division makes them ±0 (that row's
    products are NaN either way). Otherwise (a static or clipped scale, whose quotients may be far beyond ±448), and
    under the interpreter, e4m3.quantized: its division."""
    if OWN_SCALE and not INTERPRETED:
        q = quotient_rn(x, scale, tl.math.div_rn(1.0, scale))
        return tl.where(x == 0.0, x, q).to(tl.float8e4nv)  # cvt.rn.satfinite: ±448 beyond, as the clamp
    return quantized(x, scale, INTERPRETED).to(tl.float8e4nv)


@triton.jit
def row_scale(x_ptr, K, scale_ub, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
    """A row's dynamic activation scale: its absmax over K columns (clipped to scale_ub where HAS_UB) / 448,
    floored. BLOCK columns a load: one iteration's loads wait for the previous one's max, so the loop
    costs about K / BLOCK round trips to L2 (wide blocks: see kernels/gemv.amax_block)."""
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)))
    amax = tl.max(amax, axis=0)
    if HAS_UB:
        amax = tl.minimum(amax, scale_ub)
    return scale_of_absmax(amax)
