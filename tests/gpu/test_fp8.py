"""fp8 on the GPU: the scaled-matmul path of an fp8 linear layer (torch._scaled_mm, row-wise scales)
against its dequantized reference on Qwen2-7B's linear shapes, batch 1 to a prefill chunk; a
Qwen2-7B-shaped layer stack with model.quantization=fp8 against the float32 emulation of the same
e4m3 roundings and the exact float32 model; real weights (SmolLM2) in fp8 against bf16, that
emulation and transformers' float32; a block-wise fp8 checkpoint through the Triton block kernels
(tests/kernels/test_kernel_fp8_block.py holds their kernel-level checks); and the fp8 KV cache's
attention on CUDA tensors against the bf16 cache's Triton kernels.

Why the 7B-shaped stack is not held to a cosine against bf16 (issue #35): its random weights
(N(0, 0.02)) make every layer's output replace most of the residual, so any error compounds layer
after layer. e4m3's 3-bit mantissa costs each linear 3.7% relative error (activations and weights
2.65% each, with per-token and per-channel scales already), which 4 random layers turn into cosine
0.963 min / 0.973 mean against the exact float32 model in the exact float32 emulation too (CPU, 128
tokens): that bar measured e4m3, not the GPU path. Nor can the GPU path reach 0.99 against that
emulation: bf16 activations (0.9997 alike to float32 ones through 4 layers) land a few values on
the other side of an e4m3 rounding boundary, each such value moves by a whole e4m3 step, and the
random layers compound those too (0.982 min / 0.987 mean, CPU emulation of _scaled_mm). So the stack
checks what the GPU path decides: each fp8 linear on its own inputs against the emulation (0.999),
and the whole model's distance to the exact answer against the emulation's (the same, within 10%:
on CPU 0.0272 vs 0.0270 in mean 1 - cosine). The 0.99 bar against bf16 stays on real weights, as a
mean over positions (SmolLM2's test says what e4m3 costs there).
"""
from __future__ import annotations

import json

import pytest
import torch

from gpu.support import agreement, cosine_rows
from gpu.test_smollm2_agreement import llaunch_argmax, model_dir, reference  # noqa: F401 (fixtures)
from llaunch.kernels import dispatch
from llaunch.kernels.fp8 import DYNAMIC, NONE, STATIC, Fp8Weight, quantize_weight, reference_linear, scaled_mm_linear
from llaunch.kernels.kv_fp8 import KvScales, store_kv

COSINE_MIN = 0.99
# Qwen2-7B: q‖k‖v, o, gate‖up, down as (out, in)
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
@pytest.mark.parametrize("activations", [DYNAMIC, STATIC, NONE])
def test_scaled_mm_matches_the_dequantized_reference(kernel_settings, rows, shape, activations):
    """kernels.fp8_gemm=rowwise: cuBLASLt's GEMM with the token and channel scales in it."""
    kernel_settings(fp8_gemm="rowwise")
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
    served = dispatch.linear(x, fp8, bias)  # the op the decoder calls
    if rows == 1:  # one row takes the fp8 GEMV (tests/kernels/test_kernel_gemv.py holds it to these roundings)
        assert cosine_rows(served, ref).min().item() >= 0.999
    else:
        assert torch.equal(served, got)  # more rows take this path


@pytest.mark.parametrize("rows", [7, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
@pytest.mark.parametrize("activations", [DYNAMIC, STATIC])
def test_tensor_epilogue_gemm_as_close_as_the_row_wise_one(kernel_settings, rows, shape, activations):
    """kernels.fp8_gemm=tensor_epilogue: cuBLASLt's per-tensor GEMM with unit scales, its bf16 sums scaled (and the
    bias added) after it: the reference's roundings but one (cosine ≥ 0.999), as close to the exact layer as the
    row-wise GEMM."""
    torch.manual_seed(0)
    out, inp = shape
    w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02
    q, scale = quantize_weight(w)
    x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    x[:, 7] *= 30
    input_scale = (x.abs().max().float() / 448) if activations == STATIC else None
    fp8 = Fp8Weight(q, scale, activations, input_scale)
    bias = torch.randn(out, device="cuda", dtype=torch.bfloat16) * 0.1
    kernel_settings(fp8_gemm="tensor_epilogue")
    got = dispatch.linear(x, fp8, bias)
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    assert cosine_rows(got, reference_linear(x.float(), fp8, bias.float())).min().item() >= 0.999
    assert cosine_rows(got, torch.nn.functional.linear(x.float(), w.float(), bias.float())).min().item() >= COSINE_MIN


@pytest.mark.parametrize("rows", [7, 600])
@pytest.mark.parametrize("gemm", ["tensor_epilogue", "rowwise"])
@pytest.mark.parametrize("down_activations", [DYNAMIC, STATIC])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_mlp_gives_down_proj_the_unfused_bytes(kernel_settings, rows, gemm, down_activations, dtype):
    """kernels.fp8_fused_mlp: gate‖up's GEMM, then its scales, act · up and down_proj's quantization in one kernel
    (kernels/fp8_gated_quant.py): down_proj's output equals the three kernels' one after another, at either
    kernels.fp8_gemm."""
    torch.manual_seed(0)
    hidden, inner = 3584, 18944
    gate_up = Fp8Weight(*quantize_weight(torch.randn(2 * inner, hidden, device="cuda") * 0.02))
    q, scale = quantize_weight(torch.randn(hidden, inner, device="cuda") * 0.02)
    down = Fp8Weight(q, scale, down_activations,
                     torch.tensor(0.01, device="cuda") if down_activations == STATIC else None)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    x[:, 7] *= 30

    def mlp():
        return dispatch.linear(dispatch.gated_linear(x, gate_up, down), down)

    kernel_settings(fp8_fused_mlp=True, fp8_gemm=gemm)
    assert isinstance(dispatch.gated_linear(x, gate_up, down), dispatch.QuantizedRows)
    fused = mlp()
    kernel_settings(fp8_fused_mlp=False, fp8_gemm=gemm)
    unfused = mlp()
    assert fused.shape == (rows, hidden) and fused.dtype == dtype
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("tokens", [7, 600])
def test_fused_norm_gives_the_model_the_unfused_logits(kernel_settings, monkeypatch, tokens):
    """kernels.fp8_fused_norm: q‖k‖v and gate‖up take their inputs quantized by the RMSNorm kernel before them; 2
    layers of Qwen2-7B's shape (fp8 at load) prefill to the logits they give with the norm's 16-bit output
    quantized by its own kernel (tests/kernels/test_kernel_rmsnorm_quantized.py: the same bytes)."""
    arch, model = _qwen2_7b_fp8_layers(2)
    ids = torch.randint(0, arch.vocab_size, (tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    ops, fused_calls = dispatch.triton_ops(), []
    norm = ops.rmsnorm_quantized
    monkeypatch.setattr(ops, "rmsnorm_quantized", lambda *a: fused_calls.append(1) or norm(*a))
    kernel_settings(fp8_fused_norm=True)
    fused = _prefill_logits(model, ids)
    assert len(fused_calls) == 2 * arch.num_hidden_layers  # before q‖k‖v and before gate‖up, each layer
    kernel_settings(fp8_fused_norm=False)
    assert torch.equal(fused, _prefill_logits(model, ids)) and len(fused_calls) == 2 * arch.num_hidden_layers


@pytest.mark.parametrize("tokens", [7, 600])
def test_norm_epilogue_gives_the_model_the_epilogues_logits(kernel_settings, monkeypatch, tokens):
    """kernels.fp8_norm_epilogue: o_proj's and down_proj's unscaled sums go to the RMSNorm after them, q‖k‖v's to the
    rotary kernel, which apply their scales; 2 layers of Qwen2-7B's shape (fp8 at load) prefill to the logits they
    give through the epilogue kernel (tests/kernels/test_kernel_fp8_norm_epilogue.py: the same bytes), which then
    runs for the last down_proj alone."""
    arch, model = _qwen2_7b_fp8_layers(2)
    ids = torch.randint(0, arch.vocab_size, (tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    ops, calls = dispatch.triton_ops(), []
    epilogue = ops.fp8_epilogue
    monkeypatch.setattr(ops, "fp8_epilogue", lambda *a: calls.append(1) or epilogue(*a))
    kernel_settings(fp8_norm_epilogue=True)
    fused = _prefill_logits(model, ids)
    assert len(calls) == 1  # the last down_proj's: q‖k‖v's sums go to the rotary kernel, the rest to the norms
    calls.clear()
    kernel_settings(fp8_norm_epilogue=False)
    assert torch.equal(fused, _prefill_logits(model, ids)) and len(calls) == 3 * arch.num_hidden_layers


def test_norm_epilogue_in_cuda_graphs_as_the_epilogue(kernel_settings, monkeypatch, tmp_path):
    """kernels.fp8_norm_epilogue inside the runner's CUDA graphs (decode and piecewise mixed steps, kernels under PDL):
    a bf16 tiny Qwen2 quantized at load gives the tokens, top logprobs and K/V it gives through the epilogue kernel,
    for the mixed-step plans of tests/unit/test_mixed_graphs.py."""
    from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.loader import build_model
    from llaunch.runtime.worker.runner import ModelRunner
    from unit.test_mixed_graphs import ROWS, SLOTS, plans

    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model = build_model(model_config_from_folder(folder), device=torch.device("cuda"), dtype=torch.bfloat16)
    quantize_linears(model)
    ops, calls = dispatch.triton_ops(), []
    epilogue = ops.fp8_epilogue
    monkeypatch.setattr(ops, "fp8_epilogue", lambda *a: calls.append(1) or epilogue(*a))

    def serve():
        kv = model.make_kv_cache(SLOTS + 1, ROWS + 1, 96)
        runner = ModelRunner(model, kv, ROWS, torch.device("cuda"), cuda_graphs=True, prefill_graph_tokens=64,
                             mixed_graph_tokens=128)
        results = [runner.execute(plan) for plan in plans()]
        assert runner.mixed_graphs is not None and runner.mixed_graphs.replays == 2
        return [(r.rows, r.token_ids, r.top_ids, r.top_logprobs) for r in results], kv.k + kv.v

    runs = {}
    for on in (True, False):
        kernel_settings(fp8_norm_epilogue=on)
        calls.clear()
        runs[on] = (*serve(), len(calls))
    (got, got_kv, fewer), (want, want_kv, more) = runs[True], runs[False]
    assert got == want and fewer < more
    for a, b in zip(got_kv, want_kv):
        assert torch.equal(a, b)


def _qwen2_7b_fp8_layers(layers: int):
    """(arch, model): Qwen2-7B's shape cut to `layers` layers, dummy weights quantized to fp8 at load, on the GPU."""
    from gpu.conftest import profile_shape
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from

    arch = ModelArch.from_hf_config(profile_shape("qwen2-7b") | {"num_hidden_layers": layers})
    model = DecoderLM(arch, TpGroup(), torch.device("cuda"), torch.bfloat16, 4096).eval()
    load_from(model, DummySource(0, torch.device("cuda"), full_tensors=False))
    quantize_linears(model)
    return arch, model


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    from gpu.support import batch_of

    n = len(ids)
    kv = model.make_kv_cache(n + 1, 2, 4096)
    kv.req_to_slots[0, :n] = torch.arange(n, dtype=torch.int32, device=model.device)
    with torch.inference_mode():
        return model.forward(batch_of(ids, list(range(n)), list(range(n)), [], [], prefill=0,
                                      device=model.device), kv).float()


def test_quantized_qwen2_7b_shape_is_as_close_to_exact_as_e4m3_allows(kernel_settings, monkeypatch):
    """4 layers of Qwen2-7B's shape, random weights, 512 tokens prefilled. The bf16 model quantized
    at load (model.quantization=fp8, _scaled_mm) vs the same weights in float32 run by the torch
    references: unquantized (exact) and with the fp8 layers' e4m3 weights and scales (emulation)."""
    from gpu.conftest import profile_shape
    from llaunch.kernels import fp8, settings
    from llaunch.kernels.settings import Backend
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from

    arch = ModelArch.from_hf_config(profile_shape("qwen2-7b") | {"num_hidden_layers": 4})
    cuda = torch.device("cuda")
    gpu = DecoderLM(arch, TpGroup(), cuda, torch.bfloat16, 4096).eval()
    load_from(gpu, DummySource(0, cuda, full_tensors=False))
    wide = DecoderLM(arch, TpGroup(), cuda, torch.float32, 4096).eval()
    with torch.no_grad():  # the same (bf16) weights, widened
        for (_, w), (_, b) in zip(wide.named_parameters(), gpu.named_parameters(), strict=True):
            w.copy_(b.float())
    quantize_linears(gpu)
    ids = torch.randint(0, arch.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()

    per_linear = []  # every fp8 linear call's worst row against the emulation on the same input
    scaled_mm = dispatch.fp8_linear

    def checked(x, w, bias=None, unscaled=False):
        out = scaled_mm(x, w, bias, unscaled)  # as served: ScaledSums where the next kernel scales them
        y = dispatch.scaled(out)
        wide_bias = None if bias is None else bias.float()
        if isinstance(x, dispatch.QuantizedRows):  # quantized by the kernel before: the fused MLP's, or the norm's
            rows = (x.q.float() * x.scale).reshape(*x.lead, -1)
            want = torch.nn.functional.linear(rows, fp8.dequantize_weight(w, torch.float32), wide_bias)
        else:
            want = fp8.reference_linear(x.float(), w, wide_bias)
        per_linear.append(cosine_rows(y, want).min().item())
        return out

    monkeypatch.setattr(dispatch, "fp8_linear", checked)
    fp8_logits = _prefill_logits(gpu, ids)
    monkeypatch.undo()
    kernel_settings(backend=Backend.reference)  # float32 through the plain-torch ops, on the GPU
    exact = _prefill_logits(wide, ids)
    _same_fp8_weights(wide, gpu)
    emulated = _prefill_logits(wide, ids)

    gap = {name: (1 - cosine_rows(got, exact)).mean().item() for name, got in
           (("fp8 GPU", fp8_logits), ("fp8 float32 emulation", emulated))}
    both = cosine_rows(fp8_logits, emulated)
    print(json.dumps({"fp8 linear calls": len(per_linear), "worst linear row cosine": round(min(per_linear), 6),
                      "mean 1-cos to exact": {k: round(v, 5) for k, v in gap.items()},
                      "GPU vs emulation cos min/mean": [round(both.min().item(), 4), round(both.mean().item(), 4)]}))
    # with kernels.fp8_fused_mlp gate‖up runs inside gated_linear's kernel, not through fp8_linear (its bytes:
    # test_fused_mlp_gives_down_proj_the_unfused_bytes): qkv, o_proj and down_proj a layer
    per_layer = 3 if settings.current.fp8_fused_mlp else 4
    assert len(per_linear) == per_layer * arch.num_hidden_layers and min(per_linear) >= 0.999
    assert gap["fp8 GPU"] <= 1.1 * gap["fp8 float32 emulation"], gap


# the LM head as the model's dtype, e4m3 (model.fp8_lm_head) or int8 rows (model.int8_lm_head)
@pytest.mark.parametrize("head", [None, "fp8", "int8"], ids=["bf16_head", "fp8_head", "int8_head"])
def test_quantized_smollm2_loses_only_what_e4m3_loses(model_dir, reference, kernel_settings, monkeypatch,  # noqa: F811
                                                       head):
    """Real weights: SmolLM2 with model.quantization=fp8 (quantized after loading, as the loader does)
    on the 16 chats of test_smollm2_agreement, teacher-forced on transformers bf16's greedy
    continuations, against llaunch bf16, the exact float32 model, and the float32 emulation of the
    same e4m3 roundings on the same e4m3 weights (the plain-torch ops, on the GPU).

    e4m3 itself is lossy on this model. On CPU (all 30 layers, 1,024 positions) the exact emulation
    agrees with transformers float32 on 90.9% of top-1 tokens where llaunch bf16 agrees on 97.7%
    (the bf16 + _scaled_mm path, emulated: 90.4%), and its logits' cosine to float32's is 0.87 at the
    worst position, 0.991 on average. So issue #37's bar (fp8 within a point of bf16) and a minimum
    cosine measure e4m3 on SmolLM2, not the GPU path. Held here: the logits' cosine to bf16's ≥ 0.99
    on average over the scored positions (CPU: 0.9915, with all 30 layers; the mean, because the
    minimum is set by the few positions whose logits e4m3 moves most, 0.78 on CPU); top-1 agreement
    with float32 scored as served (one prefill, then 16-row decode steps) within two points of the
    emulation's (the two round a few dozen near-tie positions differently, which moves either's
    agreement by about a point both ways: 90.4% vs 90.9% on CPU over 16 chats, 91.8% vs 90.6% over 4);
    and the logits' distance to float32 (mean 1 - cosine, which averages that noise out) within 10%
    of the emulation's (CPU: 0.0085 vs 0.0087). With `head` the LM head is e4m3 too (model.fp8_lm_head: its tied
    embedding's rows quantized per row) or int8 rows (model.int8_lm_head), in every fp8 run and in the emulation."""
    from llaunch.kernels.settings import Backend
    from llaunch.runtime.models import weights
    from llaunch.runtime.models.fp8_linear import Fp8Layer, quantize_linears

    prompts, conts, _, exact = reference
    cuda = torch.device("cuda", 0)
    bf16_top = llaunch_argmax(model_dir, 0, 1, cuda, prompts, conts)

    def quantize_head(model):
        if head == "fp8":
            model.lm_head.quantize_fp8()
        else:
            model.lm_head.quantize_int8()

    quantized = []
    load = weights.load_from

    def load_and_quantize(model, source, progress=None):  # llaunch_argmax loads through weights.load_from
        load(model, source, progress)
        quantize_linears(model)
        if head:
            quantize_head(model)
        quantized.append(sum(isinstance(m, Fp8Layer) for m in model.modules()))

    monkeypatch.setattr(weights, "load_from", load_and_quantize)
    fp8_top = llaunch_argmax(model_dir, 0, 1, cuda, prompts, conts)
    monkeypatch.undo()
    assert quantized and quantized[0] > 0  # the fp8 run was one

    def scored(model) -> torch.Tensor:  # logits at the continuation positions, one prefill a chat
        return torch.cat([_prefill_logits(model, p + c)[len(p) - 1: len(p) - 1 + len(c)]
                          for p, c in zip(prompts, conts)])

    gpu, wide = (_smollm2(model_dir, cuda, dtype) for dtype in (torch.bfloat16, torch.float32))
    bf16 = scored(gpu)
    quantize_linears(gpu)
    if head:
        quantize_head(gpu)
    fp8_logits = scored(gpu)
    kernel_settings(backend=Backend.reference)  # float32 through the plain-torch ops, on the GPU
    float32 = scored(wide)
    _same_fp8_weights(wide, gpu)
    if head:
        quantize_head(wide)
        wide.lm_head.qweight.copy_(gpu.lm_head.qweight)
        wide.lm_head.weight_scale.copy_(gpu.lm_head.weight_scale)
    emulated = scored(wide)
    emulated_top = [t.argmax(-1).tolist() for t in emulated.split([len(c) for c in conts])]

    to_bf16 = cosine_rows(fp8_logits, bf16)
    gap = {name: (1 - cosine_rows(got, float32)).mean().item() for name, got in
           (("fp8 GPU", fp8_logits), ("fp8 float32 emulation", emulated), ("bf16", bf16))}
    agree = {"fp8 GPU (served)": agreement(fp8_top, exact), "fp8 float32 emulation": agreement(emulated_top, exact),
             "bf16 (served)": agreement(bf16_top, exact)}
    print(json.dumps({"LM head": head or "bf16",
                      "top-1 agreement with transformers float32": {k: round(v, 4) for k, v in agree.items()},
                      "fp8 vs bf16 logits cos min/mean": [round(x.item(), 4) for x in (to_bf16.min(), to_bf16.mean())],
                      "mean 1-cos to float32": {k: round(v, 5) for k, v in gap.items()}, "positions": to_bf16.numel()}))
    assert to_bf16.mean().item() >= COSINE_MIN
    assert agree["fp8 GPU (served)"] >= agree["fp8 float32 emulation"] - 0.02, agree
    assert gap["fp8 GPU"] <= 1.1 * gap["fp8 float32 emulation"], gap


# the e4m3 head's one-row GEMV: built in (the tensor cores at 64/256/4/3, the H200's fastest step: 2.678 vs 2.787 ms,
# fe41bbd), and the register kernel's shape (as GPUs the tensor-core kernel does not take run it)
HEAD_SHAPES = ["", "152064x3584:fp8=8/512/4"]


@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=["built_in", "register"])
@pytest.mark.parametrize("rows", [1, 5, 16])  # batch-1 decode (the fp8 GEMV), a verify step, a decode batch
def test_fp8_lm_head_logits_are_the_reference_layers(kernel_settings, rows, shape):
    """model.fp8_lm_head on Qwen2-7B's head (152,064 x 3,584, bf16): the logits the head hands the sampler (float32,
    the GEMV's at one row, the scaled GEMM's at more) against the float32 reference of the same e4m3 weights and the
    same per-token rounding of x: within two bfloat16 steps of each logit, but where the sum cancels; the same
    argmax."""
    from llaunch.runtime.models.layers import ParallelLMHead, TpGroup, VocabParallelEmbedding

    kernel_settings(gemv_shapes=shape)
    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    embedding = VocabParallelEmbedding("model.embed_tokens", 152064, 3584, TpGroup(), cuda, torch.bfloat16)
    head = ParallelLMHead("lm_head", embedding, False, cuda, torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn_like(head.weight) * 0.02)
    head.quantize_fp8()
    x = torch.randn(rows, 3584, device=cuda).to(torch.bfloat16)
    got = head(x)
    want = reference_linear(x.float(), Fp8Weight(head.qweight, head.weight_scale))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= 2 ** -7 * want.abs() + 2e-3 * want.abs().mean()).all()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _smollm2(model_dir: str, device: torch.device, dtype: torch.dtype):
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.checkpoint import read_checkpoint
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import SafetensorsSource, load_from

    model = DecoderLM(ModelArch.from_checkpoint(read_checkpoint(model_dir)), TpGroup(), device, dtype, 4096)
    source = SafetensorsSource(model_dir)
    load_from(model, source)
    source.close()
    return model.eval()


def _same_fp8_weights(wide, gpu) -> None:
    """wide's linears to fp8 holding the GPU model's e4m3 weights and scales (not wide's own rounding)."""
    from llaunch.runtime.models.fp8_linear import Fp8Layer, quantize_linears

    quantize_linears(wide)
    with torch.no_grad():
        pairs = [(a, b) for a, b in zip(wide.modules(), gpu.modules(), strict=True) if isinstance(a, Fp8Layer)]
        for a, b in pairs:
            a.qweight.copy_(b.qweight)
            a.weight_scale.copy_(b.weight_scale)


@pytest.mark.parametrize("family, qkv_block", [("qwen2", (128, 128)), ("llama", (1, 128))])
def test_block_fp8_checkpoint_runs_the_triton_kernels_as_its_reference(tmp_path, monkeypatch, family, qkv_block):
    """A block-wise fp8 checkpoint (fixtures/fp8_checkpoints.py's wide tiny one, weight_scale_inv)
    loaded on the GPU in bf16 as the worker loads it: every fp8 linear of a 300-token prefill and of
    a 16-row decode step, through the Triton block kernels, against the float32 reference of the same
    roundings on the same input. Qwen2's q‖k‖v holds a scale per block of rows, Llama's per row."""
    from fixtures.fp8_checkpoints import WIDE, write_fp8_checkpoint
    from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
    from gpu.support import batch_of
    from llaunch.kernels import fp8
    from llaunch.runtime.models.fp8_linear import Fp8Layer
    from llaunch.runtime.models.loader import build_model

    float_dir = write_tiny_checkpoint(tmp_path / "float", family, seed=3, **WIDE)
    write_fp8_checkpoint(float_dir, tmp_path / "fp8", tmp_path / "oracle", "fp8", "block", "dynamic")
    model = build_model(model_config_from_folder(tmp_path / "fp8"), device=torch.device("cuda"), dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, Fp8Layer)]
    assert len(layers) == 4 * model.arch.num_hidden_layers and layers[0].block == qkv_block
    calls = []
    kernel = dispatch.fp8_linear

    def checked(x, w, bias=None, unscaled=False):
        y = kernel(x, w, bias, unscaled)  # block-wise weights: a tensor whatever unscaled asks
        want = fp8.reference_linear(x.float(), w, None if bias is None else bias.float())
        calls.append((x.shape[0], w.block, cosine_rows(y, want).min().item()))
        return y

    monkeypatch.setattr(dispatch, "fp8_linear", checked)
    ids = torch.randint(0, model.arch.vocab_size, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    _prefill_logits(model, ids)
    kv = model.make_kv_cache(16 * 64, 17, 64)
    kv.req_to_slots[:16] = torch.arange(16 * 64, dtype=torch.int32, device="cuda").view(16, 64)
    rows = list(range(16))
    with torch.inference_mode():
        model.forward(batch_of(ids[:16], [0] * 16, [r * 64 for r in rows], rows, [1] * 16), kv)
    assert sorted({m for m, *_ in calls}) == [16, 300] and all(block is not None for _, block, _ in calls)
    assert min(c for *_, c in calls) >= 0.999, calls


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
