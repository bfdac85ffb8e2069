"""fp8 on the GPU: the scaled-matmul path of an fp8 linear layer (torch._scaled_mm, row-wise scales)
against its dequantized reference on Qwen2-7B's linear shapes, batch 1 to a prefill chunk; a whole
Qwen2-7B-shaped layer stack with model.quantization=fp8 against the bf16 model (prefill logits);
and the fp8 KV cache's attention on CUDA tensors against the bf16 cache's Triton kernels."""
from __future__ import annotations

import pytest
import torch

from gpu.support import cosine_rows
from llaunch.kernels import dispatch
from llaunch.kernels.fp8 import DYNAMIC, NONE, STATIC, Fp8Weight, quantize_weight, reference_linear, scaled_mm_linear
from llaunch.kernels.kv_fp8 import KvScales, store_kv

COSINE_MIN = 0.99
# Qwen2-7B: q‖k‖v, o, gate‖up, down as (out, in)
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
@pytest.mark.parametrize("activations", [DYNAMIC, STATIC, NONE])
def test_scaled_mm_matches_the_dequantized_reference(rows, shape, activations):
    torch.manual_seed(0)
    out, inp = shape
    w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02
    q, scale = quantize_weight(w)
    x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    x[:, 7] *= 30  # an outlier channel, as real activations have
    input_scale = (x.abs().max().float() / 448) if activations == STATIC else None
    fp8 = Fp8Weight(q, scale, activations, input_scale)
    bias = torch.randn(out, device="cuda", dtype=torch.bfloat16) * 0.1
    got = scaled_mm_linear(x, fp8, bias)
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    ref = reference_linear(x.float(), fp8, bias.float())  # the same roundings, in float32
    assert cosine_rows(got, ref).min().item() >= 0.999
    exact = torch.nn.functional.linear(x.float(), w.float(), bias.float())  # the unquantized layer
    assert cosine_rows(got, exact).min().item() >= COSINE_MIN
    assert torch.equal(dispatch.linear(x, fp8, bias), got)  # the op the decoder calls takes this path


def test_quantized_qwen2_7b_shape_prefill_close_to_bf16():
    """4 layers of Qwen2-7B's shape, random weights: fp8 (quantized at load) vs bf16 prefill logits."""
    from gpu.conftest import profile_shape
    from gpu.support import batch_of
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from

    shape = profile_shape("qwen2-7b") | {"num_hidden_layers": 4}
    arch = ModelArch.from_hf_config(shape)
    models = []
    for quantize in (False, True):
        model = DecoderLM(arch, TpGroup(), torch.device("cuda"), torch.bfloat16, 4096)
        load_from(model, DummySource(0, torch.device("cuda"), full_tensors=False))
        if quantize:
            quantize_linears(model)
        models.append(model.eval())
    n = 512
    ids = torch.randint(0, arch.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for model in models:
        kv = model.make_kv_cache(n + 1, 2, 4096)
        kv.req_to_slots[0, :n] = torch.arange(n, dtype=torch.int32, device="cuda")
        logits.append(model.forward(batch_of(ids, list(range(n)), list(range(n)), [], [], prefill=0), kv))
    assert cosine_rows(logits[1], logits[0]).min().item() >= COSINE_MIN


@pytest.mark.parametrize("seq_len", [1, 300, 2000])
def test_fp8_kv_attention_close_to_bf16_kv(seq_len):
    """The Triton decode and prefill kernels over an fp8 cache (dequantized as loaded) vs the same
    kernels over the bf16 cache, GQA 28/4 heads of 128 (Qwen2-7B)."""
    torch.manual_seed(0)
    hq, hk, d, slots = 28, 4, 128, seq_len + 8
    k = torch.randn(seq_len, hk, d, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(seq_len, hk, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(seq_len, hq, d, device="cuda", dtype=torch.bfloat16)
    where = torch.randperm(slots, device="cuda")[:seq_len]
    req_to_slots = torch.zeros((2, seq_len), dtype=torch.int32, device="cuda")
    req_to_slots[0] = where.int()
    bf16_k, bf16_v = (torch.zeros(slots, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bf16_k[where], bf16_v[where] = k, v
    fp8_k, fp8_v = (torch.zeros(slots, hk, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2))
    scales = KvScales(k.abs().max().float() / 448, v.abs().max().float() / 448)
    store_kv(fp8_k, fp8_v, where, k, v, scales)
    t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    scale = d ** -0.5
    dec = [dispatch.decode_attention(q[-1:], ck, cv, req_to_slots, t([0]), t([seq_len]), scale, kv_scales=s)
           for ck, cv, s in ((bf16_k, bf16_v, None), (fp8_k, fp8_v, scales))]
    assert cosine_rows(dec[1].flatten(1), dec[0].flatten(1)).min().item() >= COSINE_MIN
    pre = [dispatch.prefill_attention(q, ck, cv, req_to_slots, t([0]), t([0]), t([seq_len]), t([0]), scale,
                                      kv_scales=s)
           for ck, cv, s in ((bf16_k, bf16_v, None), (fp8_k, fp8_v, scales))]
    assert cosine_rows(pre[1].flatten(1), pre[0].flatten(1)).min().item() >= COSINE_MIN


def test_fp8_kv_prefill_reads_its_chunk_unrounded_as_the_reference():
    """A chunk of 300 new tokens after a 700-token fp8 prefix, its own K/V given unrounded (new_kv), as
    the decoder prefills over an fp8 cache: the Triton kernel vs the plain-torch reference."""
    from llaunch.kernels import reference
    from llaunch.kernels.kv_fp8 import Dequantizing

    torch.manual_seed(0)
    hq, hk, d, prefix, n = 28, 4, 128, 700, 300
    kv = torch.randn(prefix + n, 2 * hk, d, device="cuda", dtype=torch.bfloat16) * 3
    k, v = kv[:, :hk], kv[:, hk:]  # strided, as the qkv split gives them
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    caches = [torch.zeros(prefix + n, hk, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = KvScales(torch.tensor(0.02, device="cuda"), torch.tensor(0.01, device="cuda"))
    slots = torch.arange(prefix + n, device="cuda")
    store_kv(*caches, slots, k, v, scales)
    req_to_slots = slots.int()[None]
    t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    args = (req_to_slots, t([0]), t([0]), t([n]), t([prefix]), d ** -0.5)
    out = dispatch.prefill_attention(q, *caches, *args, kv_scales=scales, new_kv=(k[prefix:], v[prefix:]))
    ref = reference.prefill_attention(q, Dequantizing(caches[0], scales.k, q.dtype),
                                      Dequantizing(caches[1], scales.v, q.dtype), *args, k[prefix:], v[prefix:])
    assert cosine_rows(out.flatten(1).float(), ref.flatten(1).float()).min().item() >= 0.999
