"""RMSNorm whose output leaves quantized for the fp8 layer after it (kernels.fp8_fused_norm): the e4m3 values and
scales must be, byte for byte, what kernels/fp8_rows.py makes of the 16-bit norm, so the layer multiplies what it
multiplied before; and the decoder's ops (q‖k‖v, the MLP) take that input to the same output."""
import pytest
import torch

from conftest import HAS_GPU, INTERPRETED
from llaunch.kernels import dispatch, fp8
from llaunch.kernels.fp8 import DYNAMIC, STATIC


def rows(m: int, n: int, dtype, seed: int = 0) -> torch.Tensor:
    """A residual stream's rows with the corners: an outlier column, an all-zero row, a tiny row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    x[:, min(5, n - 1)] *= 40
    if m > 2:
        x[1] = 0
        x[2] = torch.randn(n, generator=g) * 1e-4
    return x.to(dtype)


def norm_weight(n: int, dtype, seed: int = 1) -> torch.Tensor:
    return (1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(dtype)


MODES = [(DYNAMIC, None), (DYNAMIC, 2.5), (STATIC, None)]


def _static(mode, device="cpu"):
    return torch.tensor(0.037, device=device) if mode == STATIC else None


def _as_unfused(ops, x, w, residual, mode, scale_ub):
    """quantize_rows of the 16-bit norm: the two kernels the fused one replaces."""
    out = ops.rmsnorm(x, w, 1e-6, residual)
    normed, h = out if residual is not None else (out, None)
    q, s = ops.quantize_rows(normed.reshape(-1, normed.shape[-1]), scale_ub, _static(mode, x.device))
    return q, s, h


def _same(got, want):
    (q, s), h = got
    want_q, want_s, want_h = want
    assert q.dtype == fp8.FP8 and s.shape == (q.shape[0], 1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if want_h is not None:
        assert torch.equal(h, want_h)


@pytest.mark.parametrize("m,n", [(5, 123), (4, 1000), (1, 64), (3, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("mode,scale_ub", MODES)
def test_the_norm_quantized_as_quantize_rows_of_it(ops, poisoned, m, n, dtype, with_residual, mode, scale_ub):
    x, w = rows(m, n, dtype), norm_weight(n, dtype)
    residual = rows(m, n, dtype, seed=2) if with_residual else None
    with poisoned():
        got = ops.rmsnorm_quantized(x, w, 1e-6, residual, scale_ub, _static(mode))
        want = _as_unfused(ops, x, w, residual, mode, scale_ub)
    _same(got if with_residual else (got, None), want)


def test_a_norm_in_another_dtype_than_its_output_is_refused(ops):
    with pytest.raises(ValueError, match="rounds the output"):
        ops.rmsnorm_quantized(rows(2, 64, torch.float32), norm_weight(64, torch.bfloat16), 1e-6)


def _layers(hidden: int, inner: int, qkv_out: int, g, down_mode=DYNAMIC):
    def weight(n, k, mode=DYNAMIC):
        q, scale = fp8.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
        return fp8.Fp8Weight(q, scale, mode, torch.tensor(0.01) if mode == STATIC else None)

    return weight(qkv_out, hidden), weight(2 * inner, hidden), weight(hidden, inner, down_mode)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("fused_mlp", [True, False])
@pytest.mark.parametrize("down_mode", [DYNAMIC, STATIC])
def test_the_decoders_ops_take_the_quantized_norm_to_the_same_output(monkeypatch, kernel_settings, m, fused_mlp,
                                                                     down_mode):
    """The norm → q‖k‖v (with its bias) and norm → gate‖up → down_proj as the decoder calls them (kernels/dispatch.py,
    the Triton path on CPU tensors under the interpreter; torch._scaled_mm runs on the CPU too): with
    kernels.fp8_fused_norm the layers get QuantizedRows and give what they give without it. One row stays 16-bit:
    the GEMV quantizes as it reads."""
    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    g = torch.Generator().manual_seed(m)
    hidden, inner = 64, 96
    qkv, gate_up, down = _layers(hidden, inner, 96, g, down_mode)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    x, residual, w = rows(m, hidden, torch.bfloat16), rows(m, hidden, torch.bfloat16, seed=3), norm_weight(hidden,
                                                                                                             torch.bfloat16)

    def layer():
        h, res = dispatch.rmsnorm(x, w, 1e-6, residual, into=qkv)
        attn_in = h
        q = dispatch.linear(h, qkv, bias)
        h2, _ = dispatch.rmsnorm(q[:, :hidden].contiguous(), w, 1e-6, res, into=gate_up)
        return attn_in, h2, q, dispatch.linear(dispatch.gated_linear(h2, gate_up, down), down)

    outs = {}
    for fused in (True, False):
        kernel_settings(fp8_fused_norm=fused, fp8_fused_mlp=fused_mlp)
        outs[fused] = layer()
    attn_in, mlp_in, *_ = outs[True]
    quantized = m > 1
    assert isinstance(attn_in, dispatch.QuantizedRows) == quantized == isinstance(mlp_in, dispatch.QuantizedRows)
    assert not isinstance(outs[False][0], dispatch.QuantizedRows)
    for got, want in zip(outs[True][2:], outs[False][2:]):
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [2, 158, 2010])
@pytest.mark.parametrize("mode,scale_ub", MODES)
def test_the_norm_quantized_at_qwen2_7b_width_gpu(m, mode, scale_ub):
    ops = dispatch.triton_ops()
    x, residual = rows(m, 3584, torch.bfloat16).cuda(), rows(m, 3584, torch.bfloat16, seed=2).cuda()
    w = norm_weight(3584, torch.bfloat16).cuda()
    got = ops.rmsnorm_quantized(x, w, 1e-6, residual, scale_ub, _static(mode, "cuda"))
    _same(got, _as_unfused(ops, x, w, residual, mode, scale_ub))


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test")
def test_a_decoder_with_fp8_linears_prefills_alike_with_the_norm_quantizing(monkeypatch, kernel_settings):
    """A 2-layer Qwen2-like float16 model quantized at load (q‖k‖v with its bias), every op on its Triton kernel
    (the interpreter): the norms hand q‖k‖v and gate‖up QuantizedRows, and the logits are those without."""
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.batch import ForwardBatch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from

    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    arch = ModelArch.from_hf_config(dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
                                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-6,
                                         max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False))
    model = DecoderLM(arch, TpGroup(), torch.device("cpu"), torch.float16, 64).eval()
    load_from(model, DummySource(0, torch.device("cpu"), full_tensors=True))
    quantize_linears(model)
    n = 9
    kv = model.make_kv_cache(n + 1, 2, 64)
    kv.req_to_slots[0, :n] = torch.arange(n, dtype=torch.int32)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = ForwardBatch(t(ids), t(list(range(n))), t(list(range(n))), t([]), t([]), t([0]), t([0]), t([n]), t([0]),
                         t(list(range(n))), 0, n, n, 0)
    norms, logits = [], {}
    ops = dispatch.triton_ops()
    norm = ops.rmsnorm_quantized
    monkeypatch.setattr(ops, "rmsnorm_quantized", lambda *a: norms.append(1) or norm(*a))
    for fused in (True, False):
        kernel_settings(fp8_fused_norm=fused)
        with torch.inference_mode():
            logits[fused] = model.forward(batch, kv).float()
    assert len(norms) == 2 * arch.num_hidden_layers
    assert torch.isfinite(logits[True]).all() and torch.equal(logits[True], logits[False])
