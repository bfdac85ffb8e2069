"""The int8 LM head (model.int8_lm_head, kernels/int8_rows.py) against kernels/int8.py's reference: one row on the
CUDA cores, a few and many rows on the tensor cores, each row alone under kernels.row_invariant; under the interpreter
at small odd shapes, on a GPU at Qwen2-7B's head in bfloat16 (also in a CUDA graph with PDL), and its sm90 builds."""
import pytest
import torch

from llaunch.kernels import int8

# (rows, vocabulary, hidden): one row, a verify step's few, a batch's many (more than one tile of rows), odd sizes
# (K of 97: the one-row path reads bytes, not words)
SHAPES = [(1, 37, 300), (1, 130, 72), (1, 29, 97), (3, 70, 100), (16, 50, 72), (33, 21, 40), (70, 45, 97)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_int8_head_interpreted(ops, poisoned, m, n, k, dtype):
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(n, k))
    x = (3 * torch.randn(m, k)).to(dtype)
    with poisoned():
        got = int8_rows.logits(x, w)
    want = int8.reference_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got - want).abs() <= order_bound(x, w)).all()


def order_bound(x: torch.Tensor, w: int8.Int8Rows) -> torch.Tensor:
    """How far the same exact float32 products summed in another order may land from the reference's sum, rounded to
    x's dtype: K float32 roundings of sums no larger than Σ|w·x| (times the row's scale), and one step of x's dtype
    where the sums fall on either side of a rounding boundary."""
    magnitude = torch.nn.functional.linear(x.float().abs(), w.weight.float().abs()) * w.scale
    step = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[x.dtype]
    return x.shape[1] * 2.0 ** -24 * magnitude + step * magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 37, 300), (1, 29, 97), (5, 70, 100), (33, 21, 40), (70, 19, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_interpreted(ops, poisoned, m, n, k, dtype, bias):
    """model.quantization=int8's layers: x's dtype out, the bias added before the one rounding, at each path (one row,
    a few, tiles of rows as x·wᵀ up to the layer's row bound, past it all rows in one tile as w·xᵀ: 70)."""
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(n, k))
    x = (3 * torch.randn(m, k)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    with poisoned():
        got = int8_rows.linear(x, w, b)
    want = int8.reference_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    bound = order_bound(x, w) + (0 if b is None else {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}[dtype]
                                 * b.float().abs())
    assert ((got.float() - want.float()).abs() <= bound).all()
    if b is not None:  # a bias that was left out moves every output by it
        assert not torch.allclose(got.float(), int8.reference_linear(x, w).float(), atol=1e-3)


def test_int8_head_rows_alike_under_row_invariant(ops, kernel_settings):
    """kernels.row_invariant: each row of a step of up to 16 on the one-row code, so its logits are the bits it gets
    alone (a verify row's are a decode row's)."""
    from llaunch.kernels import int8_rows

    kernel_settings(row_invariant=True)
    w = int8.quantize_rows(torch.randn(90, 200))
    x = torch.randn(5, 200, dtype=torch.float16)
    together = int8_rows.logits(x, w)
    assert all(torch.equal(together[i:i + 1], int8_rows.logits(x[i:i + 1], w)) for i in range(5))
    together = int8_rows.linear(x, w)  # model.quantization=int8's layers too (the rule lets row_invariant hold there)
    assert all(torch.equal(together[i:i + 1], int8_rows.linear(x[i:i + 1], w)) for i in range(5))


def test_int8_head_refuses_what_it_cannot_take(ops):
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(8, 32))
    with pytest.raises(ValueError, match="x \\[M, 32\\]"):
        int8_rows.logits(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match="int8 rows"):
        int8_rows.logits(torch.randn(2, 32), int8.Int8Rows(w.weight.float(), w.scale))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 100, 256, 300])
def test_int8_head_gpu(cuda, poisoned, m):
    """Qwen2-7B's head (152,064 x 3,584) in bfloat16: every row count's path against the reference, within what a
    sum's order may move a logit by (order_bound): one row, up to 16, one tile of 32-256 rows (100: a tile of 128
    with 28 rows masked), two tiles (300)."""
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(152064, 3584, device=cuda) / 60)
    x = (3 * torch.randn(m, 3584, device=cuda)).to(torch.bfloat16)
    with poisoned():
        got = int8_rows.logits(x, w)
    want = int8.reference_logits(x, w)
    assert ((got - want).abs() <= order_bound(x, w)).all()
    assert (got == want).float().mean() > 0.95  # most sums round alike: a wrong scale or row would move them all


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 100, 2048])
def test_int8_linear_gpu(cuda, poisoned, m):
    """model.quantization=int8: Qwen2-7B's q‖k‖v (4,608 x 3,584, with its bias) in bfloat16 at a decode step's rows
    (one, up to 16, 64-row tiles: 100 in two) and a prefill's 2,048 (8 tiles of 256 rows), against the reference."""
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(4608, 3584, device=cuda) / 60)
    x = (3 * torch.randn(m, 3584, device=cuda)).to(torch.bfloat16)
    b = torch.randn(4608, device=cuda).to(torch.bfloat16)
    with poisoned():
        got = int8_rows.linear(x, w, b)
    want = int8.reference_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    bound = order_bound(x, w) + 2.0 ** -7 * b.float().abs()
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert (got == want).float().mean() > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_int8_head_replays_in_a_cuda_graph_with_pdl(cuda, captured, m):
    """A decode graph's head (one row; 64: a batch's, one tile of rows on the tensor cores) replays new rows."""
    from llaunch.kernels import int8_rows

    w = int8.quantize_rows(torch.randn(152064, 3584, device=cuda) / 60)
    x = (3 * torch.randn(m, 3584, device=cuda)).to(torch.bfloat16)
    graph, out = captured(lambda: int8_rows.logits(x * 1, w), with_pdl=True)
    x.copy_((3 * torch.randn(m, 3584, device=cuda)).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, int8_rows.logits(x, w))


_COMPILE_HEAD = r"""
import importlib, inspect, json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
head = importlib.import_module("llaunch.kernels.int8_rows")
fn = head._rows_kernel
out = {}
# bf16 x, and float32 x (its IEEE dots: the largest tiles in shared memory), as launch_shape launches 1, 16 and 256
# rows (and 64: a smaller tile of rows)
# (and a model.quantization=int8 layer's, Qwen2-7B's q‖k‖v: bf16 out with a bias, at each of its row counts' shapes)
for name, m, x, out_type in (("one", 1, "bf16", "fp32"), ("few", 16, "bf16", "fp32"), ("many", 256, "bf16", "fp32"),
                             ("many 64", 64, "bf16", "fp32"), ("few fp32", 16, "fp32", "fp32"),
                             ("many fp32", 256, "fp32", "fp32"), ("linear", 2048, "bf16", "bf16"),
                             ("linear one", 1, "bf16", "bf16"), ("linear few", 16, "bf16", "bf16"),
                             ("linear 64", 64, "bf16", "bf16")):
    block_m, block_n, block_k, warps, stages, swap = head.launch_shape(m, name.startswith("linear"))
    constexprs = dict(PDL=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, IEEE=x == "fp32",
                      WORDS=True, INTERPRETED=False, SWAP=swap, HAS_BIAS=name.startswith("linear"))
    names = list(inspect.signature(fn.fn).parameters)
    types = {"x_ptr": "*" + x, "w_ptr": "*i8", "s_ptr": "*fp32", "b_ptr": "*" + out_type, "out_ptr": "*" + out_type}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] == "i32" or sig[n][0] == "*"}
    build = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    out[name] = {"ptx": build.asm["ptx"], "shared": build.metadata.shared}
# a wgmma whose first operand is registers: its A is a brace list of registers, not a shared-memory descriptor
a_regs = lambda ptx: any(re.match(r"\s*,\s*\{", ins.split(";", 1)[0].split("}", 1)[1])
                         for ins in ptx.split("wgmma.mma_async")[1:])
print(json.dumps({k: {"shared": v["shared"], "mma": "mma" in v["ptx"], "wait": "griddepcontrol.wait" in v["ptx"],
                      "wgmma_a_regs": a_regs(v["ptx"]), "n256": "m64n256k16" in v["ptx"],
                      "prmt": v["ptx"].count("prmt.b32"), "i2f": v["ptx"].count("cvt.rn.f32.s")}
                  for k, v in out.items()}))
"""


@pytest.mark.slow
def test_int8_head_builds_fit_sm90_and_multiply_where_planned(sm90_compile):
    """The head's three launch shapes compiled for sm90 (bf16, and the tensor-core shapes in float32 too): they fit in
    shared memory, the one-row build stays on the CUDA cores, reading words, each weight made float32 by a byte permute
    and no conversion instruction, and the others use MMAs in bf16; each waits for the previous kernel (PDL) before it
    reads x."""
    builds = sm90_compile(_COMPILE_HEAD)
    for name, build in builds.items():
        assert build["shared"] <= 232448 and build["wait"], (name, build)
    # (a float32 model's IEEE dots are FMAs on the CUDA cores: no MMA holds float32 products exactly)
    assert not builds["one"]["mma"] and builds["few"]["mma"] and builds["many"]["mma"]
    # past 16 rows the weights are the wgmma's register operand, 256 rows in one tile: each weight converted once
    assert builds["many"]["wgmma_a_regs"] and builds["many"]["n256"] and builds["many 64"]["wgmma_a_regs"], builds
    assert builds["one"]["prmt"] >= 4 and builds["one"]["i2f"] == 0, builds["one"]
