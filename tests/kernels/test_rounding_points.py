"""The GPU build keeps the rounding points the kernels spell out. The kernels are compiled for sm90
(Hopper) here, without a GPU, in a subprocess without the interpreter, and their PTX is read: a bf16
FMA in a rotary kernel would round round(x1·cos) − round(x2·sin) once instead of three times, which
is not what transformers computes (q·cos + rotate_half(q)·sin, each op rounded to bf16)."""
import pytest

_COMPILE = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llaunch.kernels import rotary

target = GPUTarget("cuda", 90, 32)
ptrs = lambda *names: {n: "*bf16" for n in names}  # noqa: E731
rot_sig = {**ptrs("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "v_out_ptr", "k_side_ptr"), "pos_ptr": "*i64",
           "slots_ptr": "*i64", **ptrs("cos_ptr", "sin_ptr", "qn_ptr", "kn_ptr"), "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32", "rs_ptr": "*fp32", "cs_ptr": "*fp32", "b_ptr": "*bf16", "eps": "fp32",
           **{n: "i32" for n in ("q_tok_stride", "q_head_stride", "k_tok_stride", "k_head_stride", "v_tok_stride",
                                 "v_head_stride", "n_q_heads", "n_k_heads", "table_stride")},
           **{n: "constexpr" for n in ("HALF", "BLOCK_HALF", "BLOCK_HQ", "BLOCK_HK", "STORE", "NORM", "FP8", "SIDE",
                                       "SUMS", "HAS_BIAS", "PDL", "INTERPRETED")}}
ptx = {}
# plain rotary, with the heads' RMSNorm first (Qwen3, Gemma 3), into an fp8 cache (the rotated k kept too), and of an
# fp8 q‖k‖v GEMM's unscaled sums (scaled and the bias added as read: kernels.fp8_norm_epilogue)
for name, norm, fp8, sums in (("rotary", False, False, False), ("rotary_norm", True, False, False),
                              ("rotary_fp8", True, True, False), ("rotary_sums", False, False, True)):
    sig = dict(rot_sig, **({"k_out_ptr": "*fp8e4nv", "v_out_ptr": "*fp8e4nv"} if fp8 else {}))
    rot = triton.compile(ASTSource(fn=rotary._rotary_kernel, signature=sig,
                                   constexprs={"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 4,
                                               "STORE": True, "NORM": norm, "FP8": fp8, "SIDE": fp8, "SUMS": sums,
                                               "HAS_BIAS": sums, "PDL": False, "INTERPRETED": False}),
                         target=target, options={"num_warps": 4, **rotary.COMPILE_OPTIONS})
    ptx[name] = rot.asm["ptx"]
print(json.dumps(ptx))
'''


@pytest.fixture(scope="module")
def sm90_ptx(sm90_compile):
    return sm90_compile(_COMPILE)


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
@pytest.mark.parametrize("kernel", ["rotary", "rotary_norm", "rotary_fp8", "rotary_sums"])
def test_rotary_kernel_compiles_without_a_bf16_fma(sm90_ptx, kernel):
    ptx = sm90_ptx[kernel]
    assert ".target sm_90" in ptx
    assert "fma.rn.bf16" not in ptx
    if kernel == "rotary_sums":  # the sums' product, rounded, then + the bias: not contracted (fp8_epilogue's order)
        assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx
