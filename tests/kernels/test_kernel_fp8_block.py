"""Block-wise fp8 (kernels/fp8_block.py): activations quantized per token per block of columns, and
the block-scaled GEMM, against the plain-torch roundings of kernels/fp8.py. Under the interpreter on
awkward shapes (a K that the block does not divide, rows of scales per block or per row, bias); on a
GPU at Qwen2-7B's linear shapes in bf16, and beside torch._scaled_mm's own block-wise scaling where
this torch and GPU have it."""
import pytest
import torch

from llaunch.kernels import dispatch, fp8
from llaunch.kernels.fp8 import DYNAMIC, Fp8Weight, group_scales, quantize_weight_blocks, reference_linear

BLOCK = (128, 128)
# Qwen2-7B: q‖k‖v, o, gate‖up, down as (out, in)
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


def activations(m: int, k: int, dtype, device="cpu") -> torch.Tensor:
    """Rows as a model has them, plus the corners of rounding: an outlier column, an all-zero row
    (the scale's floor), a row of values e4m3 holds only as subnormals next to its absmax."""
    x = torch.randn(m, k, device=device)
    x[:, min(7, k - 1)] *= 30
    if m > 2:
        x[1] = 0
        x[2] = torch.randn(k, device=device) * 1e-4
        x[2, 0] = 1.0
    return x.to(dtype)


def block_weight(n: int, k: int, block=BLOCK, device="cpu", per_row: bool = False) -> Fp8Weight:
    """A random weight quantized in blocks; per_row: its scales given one row per weight row (as a
    fused or tensor-parallel layer whose rows do not start on block boundaries holds them)."""
    w = torch.randn(n, k, device=device) / k ** 0.5
    w[: min(n, 3)] *= 20  # blocks of very different scales
    q, scale = quantize_weight_blocks(w, block)
    if per_row:
        return Fp8Weight(q, scale.repeat_interleave(block[0], dim=0)[:n].contiguous(), DYNAMIC, block=(1, block[1]))
    return Fp8Weight(q, scale, DYNAMIC, block=block)


def expected_quantized(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = group_scales(x, group)
    return fp8.to_fp8(x, fp8.expand_columns(scales, group, x.shape[1])), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k, group", [(1, 128, 128), (5, 320, 128), (3, 1100, 128), (4, 96, 32)])
def test_quantize_groups_interpreted(poisoned, dtype, m, k, group):
    from llaunch.kernels.fp8_block import quantize_groups

    x = activations(m, k, dtype)
    with poisoned():
        q, scales = quantize_groups(x, group)
    want_q, want_scales = expected_quantized(x, group)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))  # the same e4m3 bytes


@pytest.mark.parametrize("m, n, k, bias", [(1, 37, 300, False), (5, 200, 320, True), (17, 130, 256, False),
                                           (3, 64, 96, True)])
@pytest.mark.parametrize("per_row", [False, True], ids=["block-rows", "per-row"])
def test_block_linear_interpreted(poisoned, m, n, k, bias, per_row):
    from llaunch.kernels.fp8_block import fp8_block_linear

    block = (128, 128) if k % 32 else (64, 32)  # K = 96: blocks of 32 columns, three of them
    w = block_weight(n, k, block, per_row=per_row)
    x = activations(m, k, torch.float32)
    b = torch.randn(n) if bias else None
    with poisoned():
        got = fp8_block_linear(x, w, b)
    want = reference_linear(x, w, b)
    # the same roundings summed in another order: float32's, scaled by the outputs' size
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)


def test_the_linear_op_takes_the_reference_on_cpu():
    w = block_weight(40, 300)
    x = activations(3, 300, torch.float32)
    assert torch.equal(dispatch.linear(x, w), reference_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 2048])
def test_quantize_groups_gpu(cuda, poisoned, m):
    from llaunch.kernels.fp8_block import quantize_groups

    x = activations(m, 18944, torch.bfloat16, cuda)
    with poisoned():
        q, scales = quantize_groups(x, 128)
    want_q, want_scales = expected_quantized(x, 128)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES_7B, ids=[f"{o}x{i}" for o, i in SHAPES_7B])
def test_block_linear_gpu(cuda, poisoned, close, m, shape):
    n, k = shape
    w = block_weight(n, k, device=cuda, per_row=shape == SHAPES_7B[0])  # q‖k‖v as it is held at tp8
    x = activations(m, k, torch.bfloat16, cuda)
    b = (torch.randn(n, device=cuda) * 0.1).to(torch.bfloat16)
    with poisoned():
        got = dispatch.linear(x, w, b)  # the op the decoder calls
    want = reference_linear(x.float(), w, b.float())  # the same roundings, in float32
    assert got.dtype == torch.bfloat16
    close(got, want.to(torch.bfloat16))
    assert torch.nn.functional.cosine_similarity(got.float(), want, dim=-1).min().item() >= 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 256, 2048])
def test_block_linear_agrees_with_scaled_mm_blockwise(cuda, m):
    """torch._scaled_mm takes block-wise scales (1x128 activations, 128x128 weights) on SM90 with
    cuBLAS 12.9 and later; where it does, it and the Triton kernel compute the same sums."""
    from llaunch.kernels.fp8_block import fp8_block_linear, quantize_groups

    n, k = SHAPES_7B[0]
    w = block_weight(n, k, device=cuda)
    x = activations(m, k, torch.bfloat16, cuda)
    q, a_scales = quantize_groups(x, 128)
    try:  # scale_a outer-dim-major [M, K/128]; scale_b [K/128, N/128] as the transpose of [N/128, K/128]
        theirs = torch._scaled_mm(q, w.weight.t(), scale_a=a_scales.t().contiguous().t(), scale_b=w.scale.t(),
                                  out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no block-wise _scaled_mm here: "
                    f"{str(e).splitlines()[0][:200]}")
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min().item()  # noqa: E731
    want = reference_linear(x.float(), w)
    if cosine(theirs, want) < 0.9999:
        pytest.skip(f"torch {torch.__version__}'s block-wise _scaled_mm reads these scales otherwise "
                    f"(cosine {cosine(theirs, want):.4f} to the reference)")
    assert cosine(fp8_block_linear(x, w), theirs) >= 0.9999


_COMPILE = r'''
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llaunch.kernels import fp8_block as fb

target, out = GPUTarget("cuda", 90, 32), {}
sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "n_groups": "i32", "stride_xm": "i32",
       "stride_qm": "i32", "stride_sm": "i32", "GROUP": "constexpr", "GROUPS": "constexpr", "INTERPRETED": "constexpr"}
kernel = triton.compile(ASTSource(fn=fb._quantize_groups_kernel, signature=sig, constexprs=dict(
    GROUP=128, GROUPS=fb.GROUPS_PER_PROGRAM, INTERPRETED=False)), target=target)
out["quantize"] = kernel.metadata.shared
for m, group_n in ((1, 128), (64, 1), (2048, 128)):  # every launch shape, scales per block and per row
    block_m, block_n, warps, stages = fb._launch_shape(m)
    constexprs = dict(GROUP_N=group_n, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SWIZZLE_M=8)
    ints = ("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_asm", "stride_bsn")
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "bias_ptr": "*bf16"} | {k: "i32" for k in ints} | {k: "constexpr" for k in constexprs}
    # what a launch specializes on (16-byte aligned pointers, strides and K): the loads pipeline
    aligned = ("a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr", "bias_ptr", "K", "stride_am", "stride_bn",
               "stride_cm", "stride_asm", "stride_bsn")
    attrs = {(fb._block_matmul_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fb._block_matmul_kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=target, options={"num_warps": warps, "num_stages": stages})
    out[f"matmul m={m} group_n={group_n}"] = kernel.metadata.shared
print(json.dumps(out))
'''


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_block_kernels_build_for_sm90_within_its_shared_memory(sm90_compile):
    """Compiled for an H200 here, without a GPU: the quantizing kernel and the GEMM at each launch
    shape the wrapper picks (fp8 dots, bf16 out), each within 227 KB of shared memory a program."""
    shared = sm90_compile(_COMPILE)
    assert len(shared) == 4 and max(shared.values()) <= 232448, shared
