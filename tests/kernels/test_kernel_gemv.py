"""Batch-1 GEMV (plain, with bias, gated gate‖up) vs the references it replaces."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference


# The interpreter's launch shape: the register kernel, and the TMA-staged one (tiles of 16 × 64, a
# 3-deep pipeline), which takes weights whose rows a TMA descriptor can address (16-byte strides).
KERNELS = {"registers": (32, 256, 4, 0), "staged": (16, 64, 4, 3)}


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    from llaunch.kernels import gemv

    monkeypatch.setattr(gemv, "INTERPRETED_SHAPE", KERNELS[request.param])
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k", [(1, 1), (37, 300), (37, 296), (64, 256), (129, 520)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_interpreted(ops, poisoned, close, kernel, dtype, n, k, bias):
    x = torch.randn(1, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    with poisoned():
        out = ops.gemv(x, w, b)
    close(out, reference.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inner, k", [(1, 7), (45, 264), (96, 512)])
def test_gated_gemv_interpreted(ops, poisoned, close, kernel, dtype, inner, k):
    x = torch.randn(1, k).to(dtype)
    w = (2 * torch.randn(2 * inner, k) / k ** 0.5).to(dtype)
    with poisoned():
        out = ops.gemv(x, w, gated=True)
    close(out, reference.gated_linear(x, w))


@pytest.mark.parametrize("n, k", [(37, 296), (129, 520)])
def test_float32_output_is_the_input_dtype_result_widened(ops, poisoned, kernel, n, k):
    """out_dtype=float32 (the LM head's logits) stores the same values as the fp16 output, so no
    cast kernel is needed after it and greedy tokens do not move."""
    x = torch.randn(1, k).half()
    w = (torch.randn(n, k) / k ** 0.5).half()
    with poisoned():
        wide = ops.gemv(x, w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, ops.gemv(x, w).float())
    with pytest.raises(ValueError, match="out_dtype"):
        ops.gemv(x, torch.cat([w, w]), gated=True, out_dtype=torch.float32)


@pytest.mark.parametrize("gated", [False, True])
def test_x_one_tile_ahead_gives_the_same_sums(ops, gated):
    """Requesting x's next tile with the weights' next tile (X_AHEAD, every GEMV but gate_up) changes
    when x is loaded, not what is summed: bit-identical either way, gated or not."""
    import triton

    from llaunch.kernels import gemv

    x, w = torch.randn(1, 300).half(), (torch.randn(2 * 37, 300) / 300 ** 0.5).half()
    n = 37 if gated else 74
    outs = []
    for ahead in (False, True):
        out = torch.empty(1, n, dtype=x.dtype)
        gemv._gemv_kernel[(triton.cdiv(n, 16),)](x, w, x, x, x, out, out, out, n, 300, w.stride(0), n * w.stride(0),
                                                 0.0, 300, n, 1,
                                                 HAS_SCALE=False, ACT=0, HAS_UB=False, HAS_BIAS=False, GATED=gated,
                                                 PDL=0, BLOCK_N=16, BLOCK_K=64, X_AHEAD=ahead, AMAX_BLOCK=256, INTERPRETED=True,
                                                 num_warps=4)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    close_enough = reference.gated_linear(x, w) if gated else reference.linear(x, w)
    torch.testing.assert_close(outs[0], close_enough, atol=2e-3, rtol=2e-3)


def test_gemv_weight_view(ops, close, kernel):
    """A weight with a row stride wider than K (a column slice) is read through its stride."""
    x = torch.randn(1, 200)
    w = torch.randn(50, 260)[:, :200]
    close(ops.gemv(x, w), reference.linear(x, w))


def test_staged_kernel_takes_what_tma_can_address(ops, monkeypatch):
    """The staged kernel runs where a TMA descriptor can address the weight's rows (16-byte aligned
    strides); elsewhere (an fp16 row of 300 elements: 600 bytes) the register kernel does."""
    from llaunch.kernels import gemv, gemv_staged

    monkeypatch.setattr(gemv, "INTERPRETED_SHAPE", KERNELS["staged"])
    launched = []
    monkeypatch.setattr(gemv_staged, "gemv_staged", lambda *a, **kw: launched.append(a[1].shape))
    ops.gemv(torch.randn(1, 296).half(), torch.randn(8, 296).half())
    ops.gemv(torch.randn(1, 300).half(), torch.randn(8, 300).half())
    assert launched == [(8, 296)]


def test_gemv_refuses_several_rows(ops, kernel_settings):
    with pytest.raises(ValueError, match="one row"):
        ops.gemv(torch.randn(2, 8), torch.randn(4, 8))
    kernel_settings(row_invariant=True)  # the row grid takes a small step: up to 16 rows
    ops.gemv(torch.randn(16, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="one row"):
        ops.gemv(torch.randn(17, 8), torch.randn(4, 8))


def test_row_invariant_gives_a_row_of_a_step_the_bits_it_gets_alone(ops, kernel_settings, monkeypatch, kernel):
    """kernels.row_invariant: 1..kernels.skinny_rows rows of a 16-bit layer on the GEMV's row grid (each row's own
    programs running the one-row code), through the decoder's ops: plain with a bias, gated, and the LM head (float32
    logits holding the dtype's rounding); a row alone is the same bits as in a 5-row step. Without it the 5-row step
    runs the skinny GEMM (tensor cores), whose sums are ordered otherwise."""
    from llaunch.kernels import dispatch, gemv, skinny_gemm

    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)  # CPU tensors through the interpreted kernels
    g = torch.Generator().manual_seed(0)
    # 296 columns: rows a TMA descriptor addresses, so the staged kernel would take one row where it is the shape's
    w, gate_up = (torch.randn(37, 296, generator=g) / 296 ** 0.5).bfloat16(), \
        (torch.randn(2 * 45, 296, generator=g) / 296 ** 0.5).bfloat16()
    b, x = torch.randn(37, generator=g).bfloat16(), torch.randn(5, 296, generator=g).bfloat16()
    skinny, staged = [], []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(dispatch.triton_ops(), "skinny_gemm", lambda *a, **kw: skinny.append(1) or real(*a, **kw))
    monkeypatch.setattr(gemv.gemv_staged, "gemv_staged", lambda *a, **kw: staged.append(1))  # it has no row grid
    ops_of = (lambda rows: dispatch.linear(rows, w, b), lambda rows: dispatch.gated_linear(rows, gate_up),
              lambda rows: dispatch.lm_head_linear(rows, w))
    kernel_settings(row_invariant=True)
    for op in ops_of:
        step = op(x)
        assert torch.equal(torch.cat([op(x[i:i + 1]) for i in range(5)]), step)
    assert not skinny and not staged
    head = dispatch.lm_head_linear(x, w)
    assert head.dtype == torch.float32 and torch.equal(head, head.bfloat16().float())
    close_enough = torch.testing.assert_close
    close_enough(head.bfloat16(), reference.linear(x, w), atol=1.6e-2, rtol=1.6e-2)
    kernel_settings(row_invariant=False)
    ops_of[0](x), ops_of[1](x)
    assert len(skinny) == 2


def test_row_invariant_refuses_what_it_cannot_keep():
    from llaunch.kernels.settings import KernelSettings

    assert [key for key, _ in KernelSettings(row_invariant=True, gemv="cublas").problems()] == ["kernels.row_invariant"]
    assert KernelSettings(row_invariant=True, skinny_rows=0).problems() == []  # verify rows off the skinny GEMM anyway
    assert [key for key, _ in KernelSettings(row_invariant=True, skinny_one_row=["37x300"]).problems()] == [
        "kernels.skinny_one_row"]


# GPU launch shapes: the built-in ones, and the TMA-staged kernel at a few depths
GPU_SHAPES = [None, (8, 256, 4, 4), (16, 256, 4, 4), (16, 256, 8, 6), (4, 128, 4, 8)]


@pytest.fixture(params=GPU_SHAPES, ids=lambda s: "built-in" if s is None else "/".join(map(str, s)))
def gpu_shape(request, monkeypatch):
    from llaunch.kernels import gemv

    if request.param is not None:
        monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False: (*request.param, 1))
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k", [(151936, 896), (49152, 576), (37, 296)])
def test_staged_gemv_gpu_float32_and_float16(cuda, poisoned, close, monkeypatch, dtype, n, k):
    """The staged kernel in the other dtypes a model may serve in (an LM head at Qwen2-0.5B's and
    SmolLM2's sizes, as the vocabulary-sized rule sends a float32 one there) and an odd shape."""
    from llaunch.kernels import gemv

    monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False: (16, 256, 4, 4, 1))
    x = torch.randn(1, k, device=cuda).to(dtype)
    w = (torch.randn(n, k, device=cuda) / k ** 0.5).to(dtype)
    assert gemv.staged_for(w)
    with poisoned():
        out = ops.lm_head_linear(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, out.to(dtype).float())  # logits rounded to dtype
    close(out.to(dtype), reference.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, bias", [(4608, 3584, True), (3584, 3584, False), (3584, 18944, False),
                                        (896 + 2 * 128, 896, True), (5, 17, False), (5, 24, False)])
def test_gemv_gpu(cuda, poisoned, close, gpu_shape, n, k, bias):
    """Qwen2-7B's qkv, o_proj and down_proj, a Qwen2-0.5B qkv, and an odd shape, in bf16."""
    x = torch.randn(1, k, device=cuda).to(torch.bfloat16)
    w = (torch.randn(n, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, device=cuda).to(torch.bfloat16) if bias else None
    with poisoned():
        out = ops.linear(x, w, b)
    close(out, reference.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qkv 4608x3584", "o 576x576", "gate_up 2x1536x576", "down 3584x18944",
                                   "head 49152x576", "head 152064x3584"])
def test_row_invariant_rows_alike_at_model_shapes_gpu(cuda, kernel_settings, shape):
    """kernels.row_invariant on the GPU: a row of a 2-16-row step through the GEMV's row grid gets the bits it gets
    alone (the same compiled code a program: the row count is not specialized on), at Qwen2-7B's and SmolLM2's
    shapes, the LM heads' too (76k tiles a row at Qwen2-7B's)."""
    name, dims = shape.split()
    gated = dims.startswith("2x")
    n, k = map(int, dims.removeprefix("2x").split("x"))
    w = (torch.randn(2 * n if gated else n, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    kernel_settings(row_invariant=True)
    for rows in (2, 5, 16):
        x = torch.randn(rows, k, device=cuda).to(torch.bfloat16)
        if name == "head":
            op = lambda r: ops.lm_head_linear(r, w)  # noqa: E731
        elif gated:
            op = lambda r: ops.gated_linear(r, w)  # noqa: E731
        else:
            op = lambda r: ops.linear(r, w)  # noqa: E731
        step = op(x)
        assert torch.equal(torch.cat([op(x[i:i + 1]) for i in range(rows)]), step), rows
        want = reference.gated_linear(x, w) if gated else reference.linear(x, w)
        torch.testing.assert_close(step.to(torch.bfloat16), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("inner, k", [(18944, 3584), (4864, 896), (3, 100), (3, 104)])
def test_gated_gemv_gpu(cuda, poisoned, close, gpu_shape, inner, k):
    x = torch.randn(1, k, device=cuda).to(torch.bfloat16)
    w = (2 * torch.randn(2 * inner, k, device=cuda) / k ** 0.5).to(torch.bfloat16)
    with poisoned():
        out = ops.gated_linear(x, w)
    close(out, reference.gated_linear(x, w))


def test_gemv_strided_bias(ops, close):
    x, w = torch.randn(1, 40), torch.randn(30, 40)
    b = torch.randn(60)[::2]  # every other element: stride 2
    close(ops.gemv(x, w, b), reference.linear(x, w, b))


def test_gemv_refuses_what_the_reference_refuses(ops):
    with pytest.raises(ValueError, match="x is torch.float32, weight torch.float16"):
        ops.gemv(torch.randn(1, 8), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="even row count"):
        ops.gemv(torch.randn(1, 8), torch.randn(5, 8), gated=True)
    with pytest.raises(ValueError, match="x has 8 columns, weight 9"):
        ops.gemv(torch.randn(1, 8), torch.randn(4, 9))


def test_launch_shapes_from_the_config(monkeypatch, kernel_settings):
    """kernels.gemv_shapes (what the chain sweep emits) overrides the built-in shape per weight shape."""
    from llaunch.kernels import gemv, settings

    text = ("3584x3584=2/4096/8, 18944x3584:gated=16/256/8/4, 18944x3584:gated:fp8=64/256/4/3, 3584x3584:fp8=8/512/4,"
            "3584x18944:fp8=32/256/4/3/4")
    shapes = settings.parse_gemv_shapes(text)
    assert shapes == {(3584, 3584, False, False): (2, 4096, 8, 0, 1), (18944, 3584, True, False): (16, 256, 8, 4, 1),
                      (18944, 3584, True, True): (64, 256, 4, 3, 1), (3584, 3584, False, True): (8, 512, 4, 0, 1),
                      (3584, 18944, False, True): (32, 256, 4, 3, 4)}
    monkeypatch.setattr(gemv, "_INTERPRETED", False)
    kernel_settings(gemv_shapes=text)
    assert gemv.launch_shape(3584, 3584, False) == (2, 4096, 8, 0, 1)
    assert gemv.launch_shape(18944, 3584, True) == (16, 256, 8, 4, 1)
    assert gemv.launch_shape(3584, 18944, False) == (4, 1024, 4, 0, 1)  # not overridden: built in
    # e4m3 weights of the same shapes take the :fp8 keys, and only those
    assert gemv.launch_shape(18944, 3584, True, fp8=True) == (64, 256, 4, 3, 1)
    assert gemv.launch_shape(3584, 3584, False, fp8=True) == (8, 512, 4, 0, 1)
    assert gemv.launch_shape(3584, 18944, False, fp8=True) == (32, 256, 4, 3, 4)
    kernel_settings(gemv_shapes="18944x3584:gated=16/256/8/4")
    assert gemv.launch_shape(18944, 3584, True, fp8=True) != (16, 256, 8, 4, 1)
    # built in: an e4m3 down_proj read as words takes the register kernel, else the tensor cores with K split
    assert gemv.launch_shape(3584, 18944, False, fp8=True, words=True) == (32, 1024, 8, 0, 1)
    assert gemv.launch_shape(3584, 18944, False, fp8=True, words=False) == (64, 256, 4, 3, 8)


def test_fp8_swap_ab_from_the_config(kernel_settings):
    """kernels.fp8_swap_ab: the named weight shapes (gated ones by I, as the launch shapes key them) swap; a name that
    is not a weight shape is refused with the key in the message."""
    from llaunch.kernels import settings

    kernel_settings(fp8_swap_ab=["3584x18944", "18944x3584:gated"])
    assert settings.current.fp8_swap_ab == {(3584, 18944, False), (18944, 3584, True)}
    for bad in (["3584"], ["3584x18944:fp8"], [7]):
        with pytest.raises(ValueError, match="kernels.fp8_swap_ab"):
            kernel_settings(fp8_swap_ab=bad)


@pytest.mark.parametrize("text, message", [("3584x3584=2/4096", "is not NxK"), ("3584=2/4096/8", "is not NxK"),
                                           ("3584x3584=3/4096/8", "powers of two"),
                                           ("3584x3584=8/512/4/4", "blocks of at most 256"),
                                           ("3584x3584=8/256/4/1", "STAGES is 0 or ≥ 2"),
                                           ("3584x3584=8/256/4/4/2/1", "is not NxK"),
                                           ("3584x3584=8/256/4/4/2", "SPLIT"),  # bf16: no split kernel
                                           ("3584x3584:gated:fp8=8/256/4/4/2", "SPLIT"),
                                           ("3584x3584:fp8=8/256/4/4/0", "SPLIT"),
                                           ("3584x3584:fast=2/4096/8", "':gated' and ':fp8'"),
                                           ("3584x3584:fp8:gated=2/4096/8", "':gated' and ':fp8'")])
def test_launch_shapes_from_the_config_refuse_bad_values(text, message):
    from llaunch.kernels import settings

    with pytest.raises(ValueError, match=message):
        settings.parse_gemv_shapes(text)
    assert [key for key, _ in settings.KernelSettings(gemv_shapes=text).problems()] == ["kernels.gemv_shapes"]


def test_lm_head_takes_the_staged_kernel_where_it_was_measured(monkeypatch, kernel_settings):
    """A vocabulary-sized one-row product (the LM head) runs the staged kernel on Hopper, with a
    weight TMA can address; elsewhere, or with STAGES 0 from kernels.gemv_shapes, it stays on cuBLAS."""
    from llaunch.kernels import gemv, pdl

    monkeypatch.setattr(gemv, "_INTERPRETED", False)
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: True)
    qwen2_7b = torch.empty(152064, 3584, dtype=torch.bfloat16, device="meta")
    assert gemv.staged_for(qwen2_7b)
    assert not gemv.staged_for(torch.empty(152064, 3583, dtype=torch.bfloat16, device="meta"))  # 7,166-byte rows
    assert not gemv.staged_for(torch.empty(49152, 576, dtype=torch.float32, device="meta"))  # SmolLM2's: cuBLAS
    kernel_settings(gemv_shapes="152064x3584=2/1024/4/0")
    assert not gemv.staged_for(qwen2_7b)
    kernel_settings(gemv_shapes="")
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: False)
    assert not gemv.staged_for(qwen2_7b)



def fp8_layer(n: int, k: int, activations: str = "dynamic", device="cpu"):
    """A per-channel e4m3 layer; static: an input scale of 0.02 (inputs past 8.96 saturate); dynamic-ub: a token's
    absmax clipped to 2 (FBGEMM's activation_scale_ub: larger inputs saturate)."""
    from llaunch.kernels import fp8

    weight, scale = fp8.quantize_weight(torch.randn(n, k, device=device) / k ** 0.5)
    mode = activations.removesuffix("-ub")
    return fp8.Fp8Weight(weight, scale, mode, torch.tensor(0.02, device=device) if mode == fp8.STATIC else None,
                         2.0 if activations.endswith("-ub") else None)


FP8_MODES = ["dynamic", "static", "none", "dynamic-ub"]
# e4m3 layers through the built-in shapes, the tensor-core kernel (STAGES >= 2: kernels/gemv_fp8.py;
# activations "none" stay on the register kernel, whose x is not quantized) and the register kernel
FP8_KERNELS = {"built-in": None, "tensor-core": (16, 64, 4, 2, 1), "register": (16, 256, 4, 0, 1),
               "tensor-core-split": (16, 64, 4, 2, 3),  # K over 3 programs a tile, uneven (and empty) shares
               # the weights as the MMA's A operand (kernels.fp8_swap_ab), a Hopper warpgroup's 64 rows, split or not
               "swap-ab": (64, 64, 4, 2, 1), "swap-ab-split": (64, 64, 4, 2, 3),
               # the register kernel reading the weights as 32-bit words (kernels.fp8_words: bf16 x, quantized; the
               # interpreted tests' float32 and float16 models keep float32 products)
               "words": (16, 256, 4, 0, 1)}


@pytest.fixture(params=list(FP8_KERNELS))
def fp8_kernel(request, monkeypatch):
    from llaunch.kernels import gemv, settings

    shape, built_in = FP8_KERNELS[request.param], gemv.launch_shape
    if shape is not None:
        monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False:
                            shape if fp8 else built_in(n, k, gated))
    if request.param.startswith("swap-ab"):  # every shape: a set that holds them all
        monkeypatch.setattr(settings.current, "fp8_swap_ab", _EveryShape())
    if request.param in ("words", "register"):  # register: each weight to float32 (kernels.fp8_words off)
        monkeypatch.setattr(settings.current, "fp8_words", request.param == "words")
    return request.param


class _EveryShape(frozenset):
    def __contains__(self, shape):
        return True


@pytest.mark.parametrize("activations", FP8_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, bias", [(37, 300, True), (64, 256, False), (129, 520, True)])
def test_fp8_gemv_interpreted(ops, poisoned, close, fp8_kernel, activations, dtype, n, k, bias):
    """Per-channel e4m3 weights: the row quantized as the layer's activation mode says while it is read, and
    reference_linear's roundings (the same e4m3 values, summed in another order)."""
    from llaunch.kernels import fp8

    w = fp8_layer(n, k, activations)
    x = (3 * torch.randn(1, k)).to(dtype)  # some values past the static scale's and the bound's saturation
    b = torch.randn(n).to(dtype) if bias else None
    with poisoned():
        out = ops.gemv(x, w, b)
    close(out, fp8.reference_linear(x, w, b))


@pytest.mark.parametrize("activations", FP8_MODES)
@pytest.mark.parametrize("inner, k", [(45, 264), (96, 512)])
def test_fp8_gated_gemv_interpreted(ops, poisoned, close, fp8_kernel, activations, inner, k):
    from llaunch.kernels import fp8

    w = fp8_layer(2 * inner, k, activations)
    x = 3 * torch.randn(1, k)
    with poisoned():
        out = ops.gemv(x, w, gated=True)
    close(out, reference.silu_mul(fp8.reference_linear(x, w)))


def word_sum_bound(want: torch.Tensor) -> torch.Tensor:
    """How far an e4m3 layer read as words (kernels.fp8_words: float16 sums of exact products, taken into float32
    every few tiles) may land from the exact float32 layer `want`, rounded to bfloat16: two bfloat16 steps, and where
    the sum cancels a share of the outputs' mean size."""
    return 2 ** -7 * want.abs() + 2e-3 * want.abs().mean()


def assert_within_word_rounding_gated(out: torch.Tensor, want: torch.Tensor) -> None:
    """A gated e4m3 layer read as words: out = silu(gate) * up in bfloat16, where gate and up (the halves of the exact
    float32 `want`) each come within word_sum_bound and SiLU's result and the product each round to bfloat16 once.
    The bound carries those errors through silu(g) * u to first order. (Where g is far below zero and u large, one
    bfloat16 step of g moves the output by several of its own: the H100's 18944 x 3584 at 8/512/4 moved 2 of 18,944
    outputs by 11 steps, both inside this bound.)"""
    gate, up = want.chunk(2, dim=-1)
    d_gate, d_up = word_sum_bound(gate), word_sum_bound(up)
    sig = torch.sigmoid(gate)
    silu, d_silu = gate * sig, sig * (1 + gate * (1 - sig))  # silu(g) and its slope
    exact = silu * up
    bound = d_silu.abs() * up.abs() * d_gate + silu.abs() * d_up + 2 ** -7 * exact.abs() + 1e-6
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    err = (out.float() - exact).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs past the word rounding's bound, worst " \
                                 f"{float((err - bound).max()):.4g} past it"


@pytest.mark.parametrize("activations", ["static", "dynamic", "dynamic-ub"])
@pytest.mark.parametrize("gated, split", [(False, 1), (True, 1), (False, 3), (True, 3), (False, 5)])
def test_fp8_words_in_bfloat16_within_its_rounding(ops, poisoned, close, kernel_settings, monkeypatch, activations,
                                                   gated, split):
    """kernels.fp8_words in a bfloat16 model: over a K of 17 tiles (two runs of float16 sums taken into float32, then
    a partial one), ungated x past the static scale's saturation (products at the float16 bound, 784), every output within
    two bfloat16 steps of the exact float32 layer (reference_linear) but where the sum cancels; gated, that bound on
    gate and up carried through SiLU-and-multiply (assert_within_word_rounding_gated). K split
    over 3 programs a tile (6 + 6 + 5 tiles; a gated layer takes all of K) or 5 (4 tiles a share, the last one 1):
    the same bounds, and the split counters zero after the launch."""
    from llaunch.kernels import fp8, gemv, split_k

    kernel_settings(fp8_words=True)
    monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False: (8, 256, 4, 0, split))
    k = 17 * 256 - 252
    w = fp8_layer(2 * 24 if gated else 48, k, activations)
    x = ((20 if activations == "static" and not gated else 3) * torch.randn(1, k)).to(torch.bfloat16)
    want = fp8.reference_linear(x.float(), w)
    with poisoned():
        out = ops.gemv(x, w, gated=gated)
    if gated:
        assert_within_word_rounding_gated(out, want)
    else:
        assert ((out.float() - want).abs() <= word_sum_bound(want)).all()
    assert not split_k.counters(x.device, 6).any()


@pytest.mark.parametrize("activations, shape", [("none", (16, 64, 4, 2)), ("dynamic", (16, 16, 4, 2))])
def test_fp8_layers_the_tensor_cores_cannot_take_run_the_register_kernel(ops, monkeypatch, close, activations, shape):
    """A weight-only layer (x is not quantized, so no e4m3 MMA) and a tile of K < 32 (an fp8 MMA's
    smallest: it would not compile) go to the register kernel whatever kernels.gemv_shapes says."""
    from llaunch.kernels import fp8, gemv, gemv_fp8

    def refuse(*args, **kwargs):
        raise AssertionError("the tensor-core kernel was launched")

    monkeypatch.setattr(gemv_fp8, "gemv_fp8", refuse)
    monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False: (*shape, 1))
    w = fp8_layer(37, 300, activations)
    x = 3 * torch.randn(1, 300)
    close(ops.gemv(x, w), fp8.reference_linear(x, w))


def test_split_k_counters_are_zero_after_each_launch(ops, close, monkeypatch):
    """The split kernel's tile counters (taken by each program, reset by the tile's last) read zero after a launch,
    so the next launch's last program is found again: repeated launches give the reference's output each time."""
    from llaunch.kernels import fp8, gemv, split_k

    monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False: (8, 32, 4, 2, 4))
    w = fp8_layer(50, 200)  # 7 tiles, K in 4 shares of 2, 2, 2, 1 tiles
    for seed in range(3):
        x = 3 * torch.randn(1, 200, generator=torch.Generator().manual_seed(seed))
        close(ops.gemv(x, w), fp8.reference_linear(x, w))
        assert not split_k.counters(x.device, 7).any()


@pytest.mark.gpu
@pytest.mark.parametrize("with_pdl", [False, True])
@pytest.mark.parametrize("kernel", ["tensor_cores", "swap_ab", "words"])
def test_split_k_fp8_gemv_replays_in_a_cuda_graph(cuda, close, captured, monkeypatch, kernel_settings, with_pdl,
                                                  kernel):
    """Qwen2-7B's down_proj with K split 4 ways, chained twice in a captured graph as a decode step launches it
    (with PDL: each launch's programs wait for the previous one before touching the counters): on the tensor cores,
    with both layers' weights by TMA as the MMA's A operand (kernels.fp8_swap_ab), and on the register kernel reading
    words (kernels.fp8_words)."""
    from llaunch.kernels import fp8, gemv

    shape = {"tensor_cores": (32, 256, 4, 3, 4), "swap_ab": (64, 256, 4, 3, 4), "words": (32, 1024, 8, 0, 4)}[kernel]
    monkeypatch.setattr(gemv, "launch_shape", lambda n, k, gated, fp8=False, words=False:
                        shape if fp8 else (2, 1024, 4, 0, 1))
    kernel_settings(fp8_words=kernel == "words",
                    fp8_swap_ab=["3584x18944", "18944x3584"] if kernel == "swap_ab" else [])
    first, second = fp8_layer(3584, 18944, "dynamic", cuda), fp8_layer(18944, 3584, "dynamic", cuda)
    x = (3 * torch.randn(1, 18944, device=cuda)).to(torch.bfloat16)

    def chain():
        return ops.linear(ops.linear(x, first), second)

    graph, out = captured(chain, with_pdl)
    for seed in range(3):
        x.copy_((3 * torch.randn(1, 18944, device=cuda, generator=torch.Generator(cuda).manual_seed(seed))))
        graph.replay()
        assert torch.equal(out, chain())  # the sum order is fixed: replayed = eager, bit for bit
        close(ops.linear(x, first), fp8.reference_linear(x.float(), first).to(torch.bfloat16))


def test_fp8_gemv_quantizes_the_row():
    """The quantization is not a no-op at these inputs: without it the product is another one (so the
    tests above would see a GEMV that skipped it)."""
    from llaunch.kernels import fp8

    w = fp8_layer(64, 256)
    x = 3 * torch.randn(1, 256)
    unquantized = torch.nn.functional.linear(x, fp8.dequantize_weight(w, torch.float32))
    assert (fp8.reference_linear(x, w) - unquantized).abs().max() > 1e-2


def test_fp8_gemv_refuses_block_scales(ops):
    from llaunch.kernels import fp8

    weight, scale = fp8.quantize_weight_blocks(torch.randn(256, 256), (128, 128))
    with pytest.raises(ValueError, match="per-channel"):
        ops.gemv(torch.randn(1, 256), fp8.Fp8Weight(weight, scale, block=(128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("activations", FP8_MODES)
@pytest.mark.parametrize("n, k, bias", [(4608, 3584, True), (3584, 3584, False), (3584, 18944, False), (5, 24, False)])
def test_fp8_gemv_gpu(cuda, poisoned, close, fp8_kernel, activations, n, k, bias):
    """Qwen2-7B's qkv, o_proj and down_proj as fp8 layers in bf16 steps: ops.linear's one-row path (the GEMV)
    against the same e4m3 values multiplied and summed in float32, rounded once to bf16, as the kernel does (the
    reference in bf16 rounds each dequantized weight and input to bf16 too: on the H200 0.1% of the outputs then
    moved by one or two bf16 steps)."""
    from llaunch.kernels import fp8

    w = fp8_layer(n, k, activations, cuda)
    x = (3 * torch.randn(1, k, device=cuda)).to(torch.bfloat16)
    b = torch.randn(n, device=cuda).to(torch.bfloat16) if bias else None
    with poisoned():
        out = ops.linear(x, w, b)
    close(out, fp8.reference_linear(x.float(), w, None if b is None else b.float()).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("inner, k", [(18944, 3584), (3, 104)])
def test_fp8_gated_gemv_gpu(cuda, poisoned, close, fp8_kernel, inner, k):
    from llaunch.kernels import fp8, settings

    w = fp8_layer(2 * inner, k, "dynamic", cuda)
    x = (3 * torch.randn(1, k, device=cuda)).to(torch.bfloat16)
    with poisoned():
        out = ops.gated_linear(x, w)
    want = fp8.reference_linear(x.float(), w)
    if fp8_kernel in ("built-in", "words") and settings.current.fp8_words:  # float16 sums (the built-in reads words)
        assert_within_word_rounding_gated(out, want)
    else:  # gate and up summed in float32 and rounded to bf16, then SiLU-and-multiply in bf16 (the kernel's roundings)
        close(out, reference.silu_mul(want.to(torch.bfloat16)))
