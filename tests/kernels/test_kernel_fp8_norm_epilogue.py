"""An fp8 layer's scales applied by the kernel after it (kernels.fp8_norm_epilogue): the RMSNorm after o_proj and
down_proj, the rotary kernel after q‖k‖v take the per-tensor GEMM's unscaled bfloat16 sums with their token and
channel scales (and bias) and must give, byte for byte, what they give of kernels/fp8_epilogue.py's output (the
residual stream h, the normalized row or its e4m3 values and scales for the fp8 layer after it; the rotated q and
the K/V stored); and a decoder's layers the q, k, v, residual and KV cache they give through the epilogue kernel,
which then runs for the last down_proj alone."""
import pytest
import torch

from conftest import HAS_GPU, INTERPRETED
from llaunch.kernels import dispatch, fp8
from llaunch.kernels.fp8 import DYNAMIC, STATIC

MODES = [None, (None, None), (2.5, None), (None, 0.037)]  # 16-bit out; e4m3 by own / clipped / static scale


def sums(m: int, n: int, seed: int = 0):
    """A GEMM's unscaled bfloat16 sums of e4m3 products (tens to hundreds), its token and channel scales; a zero row."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(m, n, generator=g) * 80
    y[:, min(3, n - 1)] *= 20
    if m > 1:
        y[1] = 0
    rows = torch.rand(m, 1, generator=g) * 0.02 + 1e-3
    channels = torch.rand(n, generator=g) * 0.01 + 1e-4
    return y.to(torch.bfloat16), rows, channels


def _norm(ops, x, w, residual, mode, scales=None):
    if mode is None:
        return ops.rmsnorm(x, w, 1e-6, residual, scales)
    scale_ub, static = mode
    return ops.rmsnorm_quantized(x, w, 1e-6, residual, scale_ub, None if static is None else
                                 torch.tensor(static, device=x.device), scales)


def _same(got, want):
    (out, h), (want_out, want_h) = got, want
    assert torch.equal(h, want_h)
    if isinstance(out, tuple):
        assert torch.equal(out[0].view(torch.uint8), want_out[0].view(torch.uint8)) and torch.equal(out[1], want_out[1])
    else:
        assert out.dtype == want_out.dtype and torch.equal(out, want_out)


def _against_the_epilogue(ops, m, n, dtype, mode, device="cpu"):
    y, rs, cs = (t.to(device) for t in sums(m, n))
    g = torch.Generator().manual_seed(5)
    residual = (torch.randn(m, n, generator=g) * 3).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).to(device)
    got = _norm(ops, y, w, residual, mode, (rs, cs))
    want = _norm(ops, ops.fp8_epilogue(y, rs, cs, None, dtype), w, residual, mode)
    _same(got, want)


@pytest.mark.parametrize("m,n", [(5, 123), (3, 576), (1, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_the_norm_of_the_sums_as_of_the_epilogues_output(ops, poisoned, m, n, dtype, mode):
    with poisoned():
        _against_the_epilogue(ops, m, n, dtype, mode)


def test_the_scales_apply_in_the_epilogues_order(ops):
    """(sum · token scale) · channel scale, as the epilogue multiplies: sums and channel scales picked where the other
    order, sum · (token scale · channel scale), rounds to another float16 (a float16 model: the interpreter rounds
    to it as the GPU does; a zero residual keeps h the scaled sum)."""
    g, rs = torch.Generator().manual_seed(11), torch.tensor([[0.0123]])
    y = (torch.randn(1 << 21, generator=g) * 80).bfloat16().float()
    cs = torch.rand(1 << 21, generator=g) * 0.01 + 1e-4
    parted = ((y * rs[0]) * cs).half() != (y * (rs[0] * cs)).half()
    y, cs = y[parted][None, :64].bfloat16(), cs[parted][:64].contiguous()
    assert y.shape == (1, 64)
    w, residual = torch.ones(64, dtype=torch.float16), torch.zeros(1, 64, dtype=torch.float16)
    _, h = ops.rmsnorm(y, w, 1e-6, residual, (rs, cs))
    assert torch.equal(h, ((y.float() * rs) * cs).half())
    assert torch.equal(h, ops.fp8_epilogue(y, rs, cs, None, torch.float16))


def test_sums_without_a_residual_are_refused(ops):
    y, rs, cs = sums(2, 64)
    with pytest.raises(ValueError, match="residual"):
        ops.rmsnorm(y, torch.ones(64, dtype=torch.bfloat16), 1e-6, None, (rs, cs))


@pytest.mark.parametrize("t,heads,kv_heads,dim", [(5, 4, 2, 64), (3, 7, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_rotary_of_the_sums_as_of_the_epilogues_output(ops, poisoned, t, heads, kv_heads, dim, dtype, with_bias):
    """q‖k‖v's sums scaled (and the bias added) by the rotary kernel as it reads them: the rotated q and the K/V
    it stores are those of rotary_store_kv on the epilogue's output."""
    n = (heads + 2 * kv_heads) * dim
    y, rs, cs = sums(t, n, seed=t)
    g = torch.Generator().manual_seed(7)
    bias = (torch.randn(n, generator=g) * 2).to(dtype) if with_bias else None
    positions = torch.tensor([3, 0, 17, 9, 30][:t])
    slots = torch.tensor([6, 1, 4, 0, 2][:t])
    angles = torch.arange(32)[:, None] * (10000.0 ** (-torch.arange(dim // 2) / (dim // 2)))[None, :]
    cos, sin = angles.cos(), angles.sin()

    def split(x):
        q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        return q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)

    def caches():
        return torch.zeros(8, kv_heads, dim, dtype=dtype), torch.zeros(8, kv_heads, dim, dtype=dtype)

    with poisoned():
        k_cache, v_cache = caches()
        got = ops.rotary_store_kv(*split(y), positions, cos, sin, k_cache, v_cache, slots, sums=(rs, cs, bias, dtype))
        want_k, want_v = caches()
        want = ops.rotary_store_kv(*split(ops.fp8_epilogue(y, rs, cs, bias, dtype)), positions, cos, sin, want_k,
                                   want_v, slots)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v) and k_cache[slots].abs().sum() > 0


def _weight(n, k, g, mode=DYNAMIC):
    q, scale = fp8.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    return fp8.Fp8Weight(q, scale, mode, torch.tensor(0.01) if mode == STATIC else None)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float16])
def test_a_layers_sums_reach_the_norm_as_its_output_would(monkeypatch, kernel_settings, m, residual_dtype):
    """dispatch.linear(unscaled=True) of two or more rows gives ScaledSums, which dispatch.rmsnorm (into a 16-bit
    layer or an fp8 one) and dispatch.scaled take to what the scaled output gives; one row (the GEMV), the row-wise
    GEMM, a float32 model or the key off give a tensor; a residual of another dtype than the layer's, or a bias, the
    norm takes through the epilogue's output."""
    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)  # CPU tensors through the interpreted kernels
    g = torch.Generator().manual_seed(m)
    o_proj, gate_up = _weight(64, 96, g), _weight(192, 64, g)
    x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
    residual = torch.randn(m, 64, generator=g).to(residual_dtype)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    kernel_settings(fp8_norm_epilogue=True)
    lazy = dispatch.linear(x, o_proj, unscaled=True)
    assert isinstance(lazy, dispatch.ScaledSums) == (m > 1)
    kernel_settings(fp8_norm_epilogue=False)
    out = dispatch.linear(x, o_proj)
    assert not isinstance(dispatch.linear(x, o_proj, unscaled=True), dispatch.ScaledSums)
    assert torch.equal(dispatch.scaled(lazy), out)
    kernel_settings(fp8_norm_epilogue=True)
    for into in (None, gate_up):
        got, want = dispatch.rmsnorm(lazy, w, 1e-6, residual, into), dispatch.rmsnorm(out, w, 1e-6, residual, into)
        assert torch.equal(got[1], want[1])
        if isinstance(want[0], dispatch.QuantizedRows):
            assert torch.equal(got[0].q.view(torch.uint8), want[0].q.view(torch.uint8))
            assert torch.equal(got[0].scale, want[0].scale)
        else:
            assert torch.equal(got[0], want[0])
    bias = torch.randn(64, generator=g).to(torch.bfloat16)  # added after the scales: the norm leaves it to scaled()
    with_bias = dispatch.linear(x, o_proj, bias, unscaled=True)
    assert isinstance(with_bias, dispatch.ScaledSums) == (m > 1)
    assert torch.equal(dispatch.scaled(with_bias), dispatch.linear(x, o_proj, bias))
    got, want = (dispatch.rmsnorm(h, w, 1e-6, residual) for h in (with_bias, dispatch.linear(x, o_proj, bias)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a float32 model's epilogue contracts its product and bias add to an FMA, which the norm and rotary do not
    assert not isinstance(dispatch.linear(x.float(), o_proj, unscaled=True), dispatch.ScaledSums)
    kernel_settings(fp8_gemm="rowwise")
    assert not isinstance(dispatch.linear(x, o_proj, unscaled=True), dispatch.ScaledSums)


TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
def test_a_decoders_pieces_give_what_they_give_through_the_epilogue(monkeypatch, kernel_settings):
    """A 3-layer fp8 Qwen2 (quantized at load, q‖k‖v with its bias) run piece by piece as a step runs it
    (DecoderLM.piece: layer i - 1's o_proj, norm and MLP, then layer i's norm and q‖k‖v, rotary and KV store): with
    kernels.fp8_norm_epilogue its q, k, v, residual and KV cache equal those without, and the epilogue kernel runs
    for the last layer's down_proj alone (its output goes to the final norm as a tensor)."""
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from

    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    arch = ModelArch.from_hf_config(TINY)
    model = DecoderLM(arch, TpGroup(0, 1, None), torch.device("cpu"), torch.bfloat16, 64).eval()
    load_from(model, DummySource(0, torch.device("cpu"), full_tensors=False))
    quantize_linears(model)
    ops, epilogues = dispatch.triton_ops(), []
    epilogue = ops.fp8_epilogue
    monkeypatch.setattr(ops, "fp8_epilogue", lambda *a: epilogues.append(a[0].shape[1]) or epilogue(*a))
    assert model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's: added after the scales
    t = 5
    g = torch.Generator().manual_seed(3)
    attn = torch.randn(t, arch.num_attention_heads * arch.head_dim, generator=g).to(torch.bfloat16)
    positions, slots = torch.arange(t), torch.arange(t)

    def pieces():
        kv = model.make_kv_cache(16, 1, 16)
        residual = (torch.randn(t, arch.hidden_size, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
        outs = []
        for i in (1, 2, 3):
            x, k, v, residual = model.piece(i, attn, residual, positions, slots, kv, model.rope_cos, model.rope_sin)
            outs += [x, residual] + ([] if k is None else [k, v])
        return outs + kv.k + kv.v

    with torch.inference_mode():
        kernel_settings(fp8_norm_epilogue=False)
        want, unfused = pieces(), list(epilogues)
        epilogues.clear()
        kernel_settings(fp8_norm_epilogue=True)
        got = pieces()
    for a, b in zip(got, want):
        assert a is not None and not isinstance(a, dispatch.ScaledSums) and torch.equal(a, b)
    qkv_out = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    hidden = arch.hidden_size
    assert sorted(unfused) == sorted([qkv_out] * 2 + [hidden] * 6)  # 3 o_proj + 3 down_proj, 2 q‖k‖v
    assert epilogues == [hidden]  # the last down_proj's output leaves as a tensor


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [2, 158, 2010])
@pytest.mark.parametrize("mode", MODES)
def test_the_norm_of_the_sums_at_qwen2_7b_width_gpu(m, mode):
    _against_the_epilogue(dispatch.triton_ops(), m, 3584, torch.bfloat16, mode, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [2, 600])
def test_rotary_of_the_sums_at_qwen2_7b_shape_gpu(t):
    """Qwen2-7B's q‖k‖v (28 q heads, 4 KV heads of 128, bias) through the rotary kernel's scales, as the epilogue."""
    ops, heads, kv_heads, dim = dispatch.triton_ops(), 28, 4, 128
    n = (heads + 2 * kv_heads) * dim
    y, rs, cs = (x.cuda() for x in sums(t, n))
    bias = torch.randn(n, device="cuda").bfloat16()
    positions, slots = torch.randint(0, 4096, (t,), device="cuda"), torch.randperm(t, device="cuda")
    angles = torch.arange(4096, device="cuda")[:, None] * (1e6 ** (-torch.arange(64, device="cuda") / 64))[None, :]
    cos, sin = angles.cos(), angles.sin()
    results = []
    for x, scales in ((y, (rs, cs, bias, torch.bfloat16)), (ops.fp8_epilogue(y, rs, cs, bias, torch.bfloat16), None)):
        q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        k_cache, v_cache = (torch.zeros(t, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q = ops.rotary_store_kv(q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim), positions,
                                cos, sin, k_cache, v_cache, slots, sums=scales)
        results.append((q, k_cache, v_cache))
    for got, want in zip(*results):
        assert torch.equal(got, want)
