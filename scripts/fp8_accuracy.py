"""How much of a model's top-1 agreement with its float32 self each way of storing its weights keeps: SmolLM2 (all its
blocks) through the plain-torch ops in float32 on CPU, teacher-forced on this repository's docs, the linears' weights
rounded as each variant says and, where said, their inputs too. Issue #37's bar is e4m3 within one point of bf16.

Variants (the decoder's linears; the embedding and the LM head stay float32 but in `bf16`):
  bf16          the whole model in bfloat16 (llaunch's bf16 path, as served)
  bf16_int8_head  bf16 with the LM head's weights in int8 (model.int8_lm_head without fp8 linears)
  bf16_int8     bf16 with the linears' weights in int8 rows, a scale per output channel (model.quantization=int8 as
                served: quantize_linears_int8, inputs in bfloat16)
  fp8           model.quantization=fp8 as served: e4m3 weights with a scale per output channel, each token's inputs
                to e4m3 by its absmax (quantize_linears, the emulation of the GPU's roundings)
  fp8_weights   the same e4m3 weights, inputs left in float32 (weight-only)
  fp8_block128, fp8_block32   e4m3 weights with a scale per 1 x 128 / 1 x 32 block of each row, inputs float32
  fp8_gptq      e4m3 weights per channel rounded by GPTQ (each column's rounding error spread over the columns not
                yet rounded, by the inverse Hessian of its inputs on other text: --calibration), inputs float32
  int8          int8 weights with a scale per output channel (symmetric, round to nearest), inputs float32
  fp8_head_e4m3 fp8 as served, and the LM head in e4m3 too (model.fp8_lm_head: a scale per vocabulary row, each
                token's inputs to e4m3)
  fp8_head_int8 fp8 as served, and the LM head's weights in int8 with a scale per vocabulary row, inputs float32
                (model.int8_lm_head)
  fp8_head_w8a8 as fp8_head_int8, and each token's inputs to the head in int8 too (a scale per token: its absmax / 127),
                as an int8 tensor-core head would take them (not served: 3 points below fp8_head_int8)

    python scripts/fp8_accuracy.py --model .models/smollm2-135m [--variants bf16 fp8 ...] [--positions 2048]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SCORED = ["README.md", "docs/apis.md", "docs/deployment.md"]
CALIBRATION = ["docs/configuration.md"]
CHUNK = 256
VARIANTS = ["bf16", "bf16_int8_head", "bf16_int8", "fp8", "fp8_weights", "fp8_block128", "fp8_block32", "fp8_gptq", "int8", "fp8_head_e4m3",
            "fp8_head_int8", "fp8_head_w8a8"]


def chunks(tokenizer, files: list[str], tokens: int) -> list[list[int]]:
    """`tokens` tokens of the files' text in chunks of CHUNK, taken from each file's start in turn."""
    per_file = -(-tokens // len(files) // CHUNK) * CHUNK
    out = []
    for name in files:
        ids = tokenizer.encode(open(os.path.join(REPO, name)).read()).ids[:per_file]
        out += [ids[i:i + CHUNK] for i in range(0, len(ids) - CHUNK + 1, CHUNK)]
    return out[: tokens // CHUNK]


def load(model_dir: str, dtype: torch.dtype):
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.checkpoint import read_checkpoint
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import SafetensorsSource, load_from

    model = DecoderLM(ModelArch.from_checkpoint(read_checkpoint(model_dir)), TpGroup(), torch.device("cpu"), dtype,
                      4096)
    source = SafetensorsSource(model_dir)
    load_from(model, source)
    source.close()
    return model.eval()


def logits(model, texts: list[list[int]]) -> torch.Tensor:
    """Each chunk prefilled alone (one prompt, one prefill: a ForwardBatch as the tests' batch_of makes it); the logits
    of all its positions, float32."""
    from llaunch.runtime.models.batch import ForwardBatch

    out = []
    for ids in texts:
        n = len(ids)
        kv = model.make_kv_cache(n + 1, 2, 4096)
        kv.req_to_slots[0, :n] = torch.arange(n, dtype=torch.int32)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(t(ids), t(list(range(n))), t(list(range(n))), t([]), t([]), t([0]), t([0]), t([n]),
                             t([0]), t(list(range(n))), 0, n, n, 0)
        with torch.inference_mode():
            out.append(model.forward(batch, kv).float())
    return torch.cat(out)


def linears(model):
    from llaunch.runtime.models.fp8_linear import float_linears

    return [layer for _, _, layer in float_linears(model)]


def input_hessians(model, texts: list[list[int]]) -> dict[int, torch.Tensor]:
    """Σ xᵀx of each linear's inputs (float64) over the texts, by the linear's weight: q‖k‖v's and gate‖up's through
    the decoder's calls, o_proj's and down_proj's through their modules."""
    from llaunch.runtime.models import decoder

    sums: dict[int, torch.Tensor] = {}

    def record(weight, x):
        x = x.reshape(-1, x.shape[-1]).double()
        sums[weight.data_ptr()] = x.T @ x + sums.get(weight.data_ptr(), 0)

    def recording(fn):
        def call(x, weight, *args, **kwargs):
            record(weight, x)
            return fn(x, weight, *args, **kwargs)
        return call

    names = ("linear", "gated_linear", "qkv_rotary_store_kv")
    saved = {name: getattr(decoder, name) for name in names}
    hooks = [layer.register_forward_pre_hook(lambda module, args: record(module.weight, args[0]))
             for layer in linears(model) if type(layer).__name__ == "RowParallelLinear"]
    try:
        for name in names:
            setattr(decoder, name, recording(saved[name]))
        logits(model, texts)
    finally:
        for name in names:
            setattr(decoder, name, saved[name])
        for hook in hooks:
            hook.remove()
    return {id(layer): sums[layer.weight.data_ptr()] for layer in linears(model)}


def e4m3_rows(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).float().to(torch.float8_e4m3fn).to(w.dtype) * scale


def gptq(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """GPTQ (Frantar et al., 2022) onto e4m3 with per-channel scales: columns rounded in order, each one's error
    spread over the later columns by the upper Cholesky factor of the damped inverse Hessian."""
    from llaunch.kernels.fp8 import FP8_MAX

    w = w.double().clone()
    k = w.shape[1]
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        tile, errors, hi = w[:, b0:b1].clone(), torch.zeros(w.shape[0], b1 - b0, dtype=w.dtype), hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            rounded = e4m3_rows(tile[:, i], scale)
            error = (tile[:, i] - rounded) / hi[i, i]
            tile[:, i:] -= error[:, None] * hi[i, i:][None, :]
            tile[:, i] = rounded
            errors[:, i] = error
        w[:, b0:b1] = tile
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return w.float()


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w's values rounded to int8 with a scale per row (model.int8_lm_head's rounding: kernels/int8.py), as float32."""
    from llaunch.kernels import int8

    return int8.dequantized(int8.quantize_rows(w), torch.float32)


def with_head(model, variant: str):
    """The fp8_head_* variants' LM head: in e4m3 as model.fp8_lm_head serves it, its weights in int8 as model.int8_lm_head
    serves them, or those int8 weights with int8 inputs (the head's own copy: a tied embedding keeps its float32 rows
    for the lookup)."""
    head = model.lm_head
    if variant == "fp8_head_e4m3":
        head.quantize_fp8()
    elif variant == "fp8_head_int8":
        head.quantize_int8()
    elif variant == "fp8_head_w8a8":
        weight = head.embedding[0].weight if head.weight is None else head.weight
        head.weight = torch.nn.Parameter(int8_rows(weight.data), requires_grad=False)
        head_forward = head.forward
        head.forward = lambda x: head_forward(int8_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape))
    return model


def rounded(model, variant: str, calibration: list[list[int]]):
    """The model with its linears' weights as the variant stores them (float32 values of those roundings)."""
    from llaunch.kernels import fp8

    layers = linears(model)
    hessians = input_hessians(model, calibration) if variant == "fp8_gptq" else {}
    with torch.no_grad():
        for layer in layers:
            w = layer.weight.data
            if variant == "fp8_weights":
                q, scale = fp8.quantize_weight(w)
                layer.weight.data = q.float() * scale[:, None]
            elif variant.startswith("fp8_block"):
                block = (1, int(variant.removeprefix("fp8_block")))
                q, scale = fp8.quantize_weight_blocks(w, block)
                layer.weight.data = fp8.dequantize_weight(fp8.Fp8Weight(q, scale, fp8.NONE, None, None, block),
                                                          torch.float32)
            elif variant == "fp8_gptq":
                layer.weight.data = gptq(w, hessians[id(layer)])
            elif variant == "int8":
                layer.weight.data = int8_rows(w)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, ".models", "smollm2-135m"))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    ap.add_argument("--positions", type=int, default=2048, help="scored positions (chunks of 256 of the docs)")
    ap.add_argument("--calibration", type=int, default=4096, help="fp8_gptq: tokens of other docs for its Hessians")
    args = ap.parse_args()
    import dataclasses

    from tokenizers import Tokenizer

    from llaunch.kernels import settings
    from llaunch.runtime.models.fp8_linear import quantize_linears
    from llaunch.runtime.models.int8_linear import quantize_linears_int8

    settings.configure(dataclasses.replace(settings.current.settings, backend=settings.Backend.reference))
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    scored, calibration = chunks(tokenizer, SCORED, args.positions), chunks(tokenizer, CALIBRATION, args.calibration)
    top = logits(load(args.model, torch.float32), scored).argmax(-1)
    result = {"model": os.path.basename(os.path.normpath(args.model)), "positions": int(top.numel()),
              "top-1 agreement with float32": {}}
    for variant in args.variants:
        if variant.startswith("bf16"):
            model = load(args.model, torch.bfloat16)
            if variant == "bf16_int8_head":
                model.lm_head.quantize_int8()
            if variant == "bf16_int8":
                quantize_linears_int8(model)
        else:
            model = load(args.model, torch.float32)
            if variant == "fp8" or variant.startswith("fp8_head_"):
                quantize_linears(model)
                with_head(model, variant)  # (fp8: the head as it is)
            else:
                rounded(model, variant, calibration)
        agree = (logits(model, scored).argmax(-1) == top).float().mean().item()
        result["top-1 agreement with float32"][variant] = round(agree, 4)
        print(json.dumps({variant: round(agree, 4)}), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
