"""Batch-1 decode step time per set of GEMV launch shapes (kernels.gemv_shapes), as the worker runs the step
(its decode CUDA graph, PDL as configured by default), on the Qwen2-7B shape with random weights in bf16 or
fp8 (model.quantization=fp8: e4m3 weights, per-channel scales, dynamic per-token activations), or on
Qwen3-30B-A3B's (--shape qwen3-30b-a3b, bf16: its attention's and router's GEMVs, and the step with the MoE
kernels launched without PDL or letting the next launch only after their wait: kernels.pdl_kernels / pdl_late). How the
built-in launch shapes of kernels/gemv.py are picked: each candidate overrides the shape of one layer kind
and the whole step is timed, so a shape is judged in the chain of kernels it runs in. One JSON line per
candidate, then the best per layer kind.

    python scripts/bench_decode_shapes.py [--fp8] [--layers 28] [--repeats 50]
        [--fp8-lm-head] [--tensor-core] [--swap-ab] [--amax-tile N] [--no-words] [--candidates "NxK[:gated][:fp8]=BLOCK_N/BLOCK_K/WARPS ..."]   (default: a built-in grid per layer kind)
        (a candidate `set:KEY=VALUE` times one other kernels setting for every kind, e.g. set:fp8_words=false)
    python scripts/bench_decode_shapes.py --shape qwen3-30b-a3b --layers 48 [--skinny]   (--skinny: each kind on the
        tensor cores, kernels.skinny_one_row, instead of the GEMV)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from bench_steps import QWEN2_7B  # scripts/ is on the path of a script run
from bench_verify_steps import per_step_ms
from profile_kernels import QWEN3_30B_A3B

from llaunch.kernels import gemv, settings
from llaunch.kernels.settings import KernelSettings
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.fp8_linear import quantize_linears
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import DummySource, load_from
from llaunch.runtime.worker.cuda_graphs import DecodeGraphs

# Qwen2-7B's one-row linears by their launch-shape key (N, K, gated): qkv, o_proj, gate‖up (N: I), down_proj
KINDS = {"qkv": "4608x3584", "o_proj": "3584x3584", "gate_up": "18944x3584:gated", "down": "3584x18944"}
# Qwen3-30B-A3B's: qkv, o_proj and the router (its experts are kernels.moe_shapes', scripts/tune_moe.py)
MOE_KINDS = {"qkv": "5120x2048", "o_proj": "2048x4096", "router": "128x2048"}
SHAPES = {"qwen2-7b": (dict(QWEN2_7B, model_type="qwen2"), KINDS), "qwen3-30b-a3b": (QWEN3_30B_A3B, MOE_KINDS)}
ROUTER = ["1/1024/4", "1/2048/4", "1/2048/8", "2/2048/8", "4/512/4"]
PLAIN = ["2/1024/4", "4/1024/4", "4/2048/4", "8/512/4", "8/1024/4", "8/1024/8", "16/256/4", "16/512/4",
         "16/512/8", "16/1024/8", "32/256/4", "32/512/8"]
GATED = ["4/512/4", "8/256/4", "8/512/4", "8/512/8", "16/256/4", "16/256/8", "16/512/8", "32/256/8"]
# e4m3 weights on the tensor cores (kernels/gemv_fp8.py: STAGES >= 2), the same grid for every kind
MMA = ["16/128/4/4", "16/256/4/4", "16/256/4/6", "32/128/4/4", "32/256/4/3", "32/256/4/4", "64/128/4/4", "64/256/4/3"]
# and K split over SPLIT programs a tile (ungated layers: qkv, o_proj, down_proj have too few tiles for 132 SMs)
MMA_SPLIT = ["16/256/4/4/2", "16/256/4/4/4", "32/256/4/3/2", "32/256/4/3/4", "32/256/4/4/8", "64/256/4/3/4",
             "16/128/4/4/8", "32/128/4/4/8"]


# bf16 one-row layers on the tensor cores instead of the GEMV (kernels/skinny_gemm.py, kernels.skinny_one_row):
# BLOCK_N/BLOCK_K/WARPS/STAGES/SPLIT, K split on ungated layers
SKINNY = ["64/128/4/4/1", "64/128/4/4/2", "64/128/4/4/4", "32/128/4/4/4", "32/128/4/4/8", "64/256/4/3/2",
          "128/128/8/3/1", "128/128/8/3/2"]
SKINNY_GATED = ["32/128/4/4", "64/128/4/4", "32/256/4/3", "16/128/4/4", "64/128/8/3"]


def skinny_grid(kinds: dict[str, str]) -> list[tuple[str, dict]]:
    """(layer kind, kernel settings) per candidate: the kind's shape on the tensor cores at each launch."""
    return [(kind, dict(skinny_one_row=[key], skinny_shapes=f"{key}={launch}")) for kind, key in kinds.items()
            for launch in (SKINNY_GATED if key.endswith(":gated") else SKINNY)]


def merged(overrides: list[dict]) -> dict:
    """One set of kernel settings from each kind's best: the launch-shape strings joined, the shape lists added."""
    out: dict = {}
    for o in overrides:
        for key, value in o.items():
            if isinstance(value, list):
                out[key] = out.get(key, []) + value
            else:
                out[key] = f"{out[key]},{value}" if key in out else value
    return out


def serve_args(overrides: dict) -> str:
    """The llaunch overrides that serve these settings."""
    return " ".join(f"kernels.{k}=[{','.join(v)}]" if isinstance(v, list) else f'kernels.{k}="{v}"'
                    if isinstance(v, str) else f"kernels.{k}={str(v).lower()}" for k, v in overrides.items())


def candidate(text: str, named: dict[str, str]) -> tuple[str, dict]:
    """(layer kind, kernel settings) of a --candidates item: a kernels.gemv_shapes value (its shape's kind), or
    `set:KEY=VALUE`, one other kernels setting (an int, true / false or a string) for every kind at once."""
    if text.startswith("set:"):
        key, _, value = text.removeprefix("set:").partition("=")
        parsed = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value)
        return key, {key: parsed}
    return named.get(text.split("=")[0].removesuffix(":fp8"), "given"), dict(gemv_shapes=text)


def grid(kinds: dict[str, str], tensor_core: bool, fp8: bool) -> list[tuple[str, dict]]:
    """(layer kind, kernel settings to override) per candidate."""
    suffix = ":fp8" if fp8 else ""  # e4m3 weights' keys
    shapes = [(kind, dict(gemv_shapes=f"{key}{suffix}={shape}")) for kind, key in kinds.items()
              for shape in (MMA + ([] if key.endswith(":gated") else MMA_SPLIT) if tensor_core else
                            GATED if key.endswith(":gated") else
                            ROUTER + PLAIN[:4] if kind == "router" else PLAIN)]
    if "router" not in kinds:
        return shapes
    defaults = KernelSettings()
    return shapes + [("moe_pdl", dict(pdl_kernels=[k for k in defaults.pdl_kernels if k != "moe"])),
                     ("moe_pdl", dict(pdl_late=[*defaults.pdl_late, "moe"]))]


def dims(key: str) -> tuple[int, int, bool]:
    """(N, K, gated) of a layer kind's key NxK[:gated]."""
    shape, _, kind = key.partition(":")
    n, k = (int(v) for v in shape.split("x"))
    return n, k, kind == "gated"


def swapped(candidates: list[tuple[str, dict]], kinds: dict[str, str]) -> list[tuple[str, dict]]:
    """--swap-ab: each layer kind with its built-in shape, then each candidate, again with the weights as the MMA's A
    operand (kernels.fp8_swap_ab names the kind's weight shape) after it as is."""
    out = [(kind, dict(fp8_swap_ab=[key])) for kind, key in kinds.items()
           # built in on the tensor cores (a bf16 model's e4m3 layers read as words where kernels.fp8_words)
           if gemv.launch_shape(*dims(key), True, words=settings.current.fp8_words)[3] >= 2]
    for kind, overrides in candidates:
        out.append((kind, overrides))
        if kind in kinds:
            out.append((kind, dict(overrides, fp8_swap_ab=[kinds[kind]])))
    return out


def per_kind(model, repeats: int) -> None:
    """Each layer kind's one-row products over all layers, back to back in one CUDA graph (PDL as in the
    decode graphs), with the built-in shapes: the weight bytes read per second."""
    from llaunch.kernels import dispatch, pdl

    kinds = {"qkv": lambda l: l.self_attn.qkv_proj, "o_proj": lambda l: l.self_attn.o_proj,
             "gate_up": lambda l: l.mlp.gate_up_proj, "down": lambda l: l.mlp.down_proj}
    for kind, get in kinds.items():
        weights = [get(layer).weight for layer in model.layers]
        tensors = [getattr(w, "weight", w) for w in weights]  # an Fp8Weight's e4m3 tensor
        gated = kind == "gate_up"
        x = torch.randn(1, tensors[0].shape[1], device="cuda", dtype=torch.bfloat16)

        def chain():
            for w in weights:
                dispatch.gated_linear(x, w) if gated else dispatch.linear(x, w)
        with pdl.for_graphs():
            chain()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
        ms = per_step_ms(graph.replay, repeats, True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        print(json.dumps(dict(kind=kind, per_layer_us=round(ms * 1e3 / len(weights), 2), ms=round(ms, 4),
                              gbps=round(nbytes / ms / 1e6, 1))), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights (model.quantization=fp8)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=50, help="steps launched back to back per timing")
    ap.add_argument("--fp8-lm-head", action="store_true", help="--fp8: the LM head in e4m3 too (model.fp8_lm_head)")
    ap.add_argument("--int8-lm-head", action="store_true", help="the LM head's weights in int8 (model.int8_lm_head)")
    ap.add_argument("--tensor-core", action="store_true", help="--fp8: the grid of the tensor-core kernel")
    ap.add_argument("--swap-ab", action="store_true",
                    help="--fp8: each tensor-core candidate again with the weights as the MMA's A operand "
                         "(kernels.fp8_swap_ab), and each kind's built-in shape so")
    ap.add_argument("--amax-tile", type=int, default=None, help="--fp8: kernels/gemv.AMAX_TILE (x's absmax loads)")
    ap.add_argument("--per-kind", action="store_true",
                    help="first each layer kind's GEMVs alone: all layers' chained in a CUDA graph, GB/s")
    ap.add_argument("--activations", default=None, choices=["dynamic", "static", "none"],
                    help="--fp8: every layer's activation mode instead of dynamic (none: x not quantized, a diagnosis)")
    ap.add_argument("--no-words", dest="words", action="store_false",
                    help="--fp8: the register kernel converts each e4m3 weight alone (kernels.fp8_words=false; served "
                         "default: as 32-bit words)")
    ap.add_argument("--candidates", default=None,
                    help="space-separated kernels.gemv_shapes values, or set:KEY=VALUE for another kernels setting")
    ap.add_argument("--skinny", action="store_true",
                    help="bf16: each layer kind's one-row products on the tensor cores (kernels.skinny_one_row) at "
                         "several launches (kernels.skinny_shapes) instead of the GEMV's shapes")
    args = ap.parse_args()
    if (args.tensor_core or args.swap_ab or args.amax_tile or args.activations or not args.words
            or args.fp8_lm_head) and not args.fp8:
        ap.error("--tensor-core, --swap-ab, --amax-tile, --activations, --no-words and --fp8-lm-head are for --fp8")
    if args.fp8_lm_head and args.int8_lm_head:
        ap.error("--fp8-lm-head or --int8-lm-head: the head is stored one way")
    if args.skinny and (args.fp8 or args.candidates):
        ap.error("--skinny is for bf16 weights, without --candidates")
    config, kinds = SHAPES[args.shape]
    if args.shape != "qwen2-7b" and (args.fp8 or args.per_kind):
        ap.error("--fp8 and --per-kind are for the qwen2-7b shape")
    if args.amax_tile and args.amax_tile & (args.amax_tile - 1):
        ap.error("--amax-tile: a power of two")
    if args.amax_tile:
        gemv.AMAX_TILE = args.amax_tile
    device = torch.device("cuda")
    arch = ModelArch.from_hf_config(dict(config, num_hidden_layers=args.layers))
    span = args.context + 8
    model = DecoderLM(arch, TpGroup(0, 1, None), device, torch.bfloat16, span).eval()
    load_from(model, DummySource(0, device, full_tensors=False))
    if args.fp8:
        quantize_linears(model)
        for module in model.modules():
            if args.activations and hasattr(module, "activations"):
                module.activations = args.activations
    if args.fp8_lm_head:
        model.lm_head.quantize_fp8()
    if args.int8_lm_head:
        model.lm_head.quantize_int8()
    kv = model.make_kv_cache(span + 1, 2, span)
    kv.req_to_slots[0] = torch.arange(span, dtype=torch.int32, device=device)
    kv.req_to_slots[1].fill_(span)
    last_token = torch.full((2,), 7, dtype=torch.int64, device=device)
    base_settings = dataclasses.replace(settings.current.settings, fp8_words=args.words)
    settings.configure(base_settings)  # --per-kind's chains run with it too
    c = args.context

    def step_ms(overrides: dict) -> float:
        settings.configure(dataclasses.replace(base_settings, **overrides))
        graphs = DecodeGraphs(model, kv, last_token, 1, span, scratch_row=1, scratch_slot=span)
        graphs.capture()
        ms = per_step_ms(lambda: graphs.run([0], [c - 1], [c - 1], [c]), args.repeats, True)
        del graphs
        return ms

    where = dict(shape=args.shape, weights="fp8" if args.fp8 else "bf16", fp8_lm_head=args.fp8_lm_head,
                 int8_lm_head=args.int8_lm_head,
                 activations=args.activations, amax_tile=gemv.AMAX_TILE,
                 words=args.words, layers=args.layers, context=c,
                 device=torch.cuda.get_device_name())
    if args.per_kind:
        per_kind(model, args.repeats)
    base = step_ms({})
    print(json.dumps(dict(kind="built-in", shapes="", ms=round(base, 4), **where)), flush=True)
    named = {key: kind for kind, key in kinds.items()}  # a given candidate of one shape: its layer kind
    candidates = ([candidate(s, named) for s in args.candidates.split()] if args.candidates
                  else skinny_grid(kinds) if args.skinny else grid(kinds, args.tensor_core, args.fp8))
    if args.swap_ab:
        candidates = swapped(candidates, KINDS)
    best: dict[str, tuple[float, dict]] = {}
    for kind, overrides in candidates:
        try:
            ms = step_ms(overrides)
        except Exception as e:  # a shape the compiler refuses (registers, shared memory) is a result too
            print(json.dumps(dict(kind=kind, **overrides, error=str(e)[:200])), flush=True)
            continue
        print(json.dumps(dict(kind=kind, **overrides, ms=round(ms, 4), ratio=round(ms / base, 4))), flush=True)
        if kind != "moe_pdl" and ms < best.get(kind, (base, {}))[0]:  # launch shapes: the best per kind combine
            best[kind] = (ms, overrides)
    combined = merged([o for _, o in best.values()])
    summary = dict(kind="summary", built_in_ms=round(base, 4), best={k: v[1] for k, v in best.items()})
    if combined:
        summary.update(combined=combined, combined_ms=round(step_ms(combined), 4),
                       built_in_again_ms=round(step_ms({}), 4), serve=serve_args(combined))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
