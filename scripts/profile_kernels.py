"""Which kernels a forward step's device time goes to, bf16 against model.quantization=fp8: the Qwen2-7B shape
(--shape qwen3-30b-a3b: the MoE's, bf16 only) with random weights, a decode step of each --rows (every row holding --context tokens) and a mixed step
(--mixed-rows decode rows, 64, plus --mixed-prompts prompts of --chunk-len tokens, one of 256), each captured in a CUDA graph where it can be (as the worker runs
decode steps) and timed by its replays, then once under torch.profiler: the kernels by device time, summed
over the step's layers. One JSON line per step and weight format, then the kernel table.

    python scripts/profile_kernels.py [--layers 28] [--rows 1 64 165 256] [--formats bf16 fp8] [--top 12]
    python scripts/profile_kernels.py --shape qwen3-30b-a3b --layers 48 --formats bf16
    python scripts/profile_kernels.py --rows 1 --mixed-rows 218 --mixed-prompts 2 --chunk-len 896   (c256's mixed step)
    python scripts/profile_kernels.py --formats fp8 --set fp8_fused_mlp=false --set fp8_gemm=tensor_epilogue
    python scripts/profile_kernels.py --cpu --layers 2   (a smoke run: the CPU's op names, times mean nothing)
    python scripts/profile_kernels.py --formats bf16 --kv fp8_e4m3 --rows 1 --chunk-len 1024 --prefix 7168
        (long256's mixed step: a chunk of an 8,192-token prompt over its cached 7,168, the KV in e4m3)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_steps import QWEN2_7B, SPAN, step_batch  # scripts/ is on the path of a script run
from llaunch.kernels import settings
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.config import CacheConfig, KvDType
from llaunch.runtime.models.fp8_linear import quantize_linears
from llaunch.runtime.models.kv_fp8 import use_fp8_kv
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import DummySource, load_from

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
SHAPES = {"qwen2-7b": dict(QWEN2_7B, model_type="qwen2"), "qwen3-30b-a3b": QWEN3_30B_A3B}
TINY_MOE = dict(TINY, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def build(fmt: str, layers: int, cuda: bool, rows: int, shape_name: str = "qwen2-7b", kv_dtype: str = "auto",
          span: int = SPAN):
    device = torch.device("cuda" if cuda else "cpu")
    tiny = TINY_MOE if "num_experts" in SHAPES[shape_name] else TINY
    shape = dict(SHAPES[shape_name], num_hidden_layers=layers, **({} if cuda else tiny))
    arch = ModelArch.from_hf_config(shape)
    model = DecoderLM(arch, TpGroup(0, 1, None), device, torch.bfloat16 if cuda else torch.float32, SPAN).eval()
    load_from(model, DummySource(0, device, full_tensors=False))
    if fmt in ("fp8", "fp8head", "fp8int8head"):
        quantize_linears(model)
    if fmt == "fp8head":  # model.fp8_lm_head
        model.lm_head.quantize_fp8()
    if fmt == "fp8int8head":  # model.int8_lm_head
        model.lm_head.quantize_int8()
    use_fp8_kv(model, CacheConfig(kv_dtype=KvDType(kv_dtype)))  # cache.kv_dtype (scales 1.0: random weights)
    kv = model.make_kv_cache(rows * span + 1, rows + 1, span)
    kv.req_to_slots[:rows] = torch.arange(rows * span, dtype=torch.int32, device=device).view(rows, span)
    return model, kv


def step_fn(model, kv, batch, cuda: bool):
    """The step as a callable: a CUDA graph's replay where capture works, else the eager forward."""
    run = lambda: model.forward(batch, kv)  # noqa: E731
    if not cuda:
        return run, "eager"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay, "graph"
    except Exception as e:  # a step whose forward syncs with the host: timed eager
        print(f"# capture failed ({type(e).__name__}: {str(e)[:80]}): eager", file=sys.stderr)
        torch.cuda.synchronize()
        return run, "eager"


def apply_settings(pairs: list[str]) -> None:
    """--set KEY=VALUE: kernels settings as a worker's `kernels` config would give them (bools, ints, strings,
    choices)."""
    if not pairs:
        return
    changes = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        current = getattr(settings.current.settings, key)  # an unknown key fails here
        changes[key] = value.lower() in ("1", "true", "yes") if isinstance(current, bool) else type(current)(value)
    settings.configure(dataclasses.replace(settings.current.settings, **changes))
    print(json.dumps(dict(kernels=changes), default=str))


def device_ms(fn, cuda: bool, repeats: int = 20) -> float:
    if not cuda:
        return float("nan")
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_table(fn, cuda: bool) -> list[tuple[str, float, int]]:
    """(kernel name, device ms per step, launches per step), largest first."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and ev.cpu_parent is not None:  # the CPU smoke: top-level ops only
            continue
        name = ev.name[:90]
        totals[name] += (ev.device_time if cuda else ev.cpu_time) / 1e3
        counts[name] += 1
    return sorted(((n, t, counts[n]) for n, t in totals.items()), key=lambda x: -x[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 165, 256], help="decode steps' rows")
    ap.add_argument("--context", type=int, default=1152, help="tokens each decode row holds")
    ap.add_argument("--chunk-len", type=int, default=256, help="the mixed step's prompt (0: no mixed step)")
    ap.add_argument("--mixed-rows", type=int, default=64, help="the mixed step's decode rows")
    ap.add_argument("--mixed-prompts", type=int, default=1,
                    help="the mixed step's prompts of --chunk-len tokens (c256's: ~218 rows beside ~1,800 tokens)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "fp8head", "fp8int8head"],
                    help="fp8head: fp8 with the LM head in e4m3 too (model.fp8_lm_head); fp8int8head: in int8 "
                         "(model.int8_lm_head)")
    ap.add_argument("--prefix", type=int, default=0, help="the mixed step's prompts' cached tokens before their chunk")
    ap.add_argument("--kv", default="auto", choices=[k.value for k in KvDType], help="cache.kv_dtype")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kernels setting for every step (kernels/settings.py), e.g. --set fp8_fused_mlp=false")
    args = ap.parse_args()
    apply_settings(args.set)
    cuda = torch.cuda.is_available() and not args.cpu
    shapes = [(r, 0) for r in args.rows] + ([(args.mixed_rows, args.mixed_prompts)] if args.chunk_len else [])
    most = max(r + p for r, p in shapes) + 1
    span = max(SPAN, args.prefix + args.chunk_len)
    for fmt in args.formats:
        model, kv = build(fmt, args.layers, cuda, most, args.shape, args.kv, span)
        for rows, prompts in shapes:
            batch = step_batch(rows, min(args.context, span - args.chunk_len), prompts, args.chunk_len,
                               kv.req_to_slots.device, args.prefix if prompts else 0, span)
            with torch.inference_mode():
                fn, how = step_fn(model, kv, batch, cuda)
                ms = device_ms(fn, cuda)
                table = kernel_table(fn, cuda)
            print(json.dumps(dict(format=fmt, kv=args.kv, decode_rows=rows, prefill_tokens=prompts * args.chunk_len,
                                  prefix=args.prefix if prompts else 0,
                                  layers=args.layers, launch=how, step_ms=round(ms, 3),
                                  kernels_ms=round(sum(t for _, t, _ in table), 3))))
            for name, t, n in table[:args.top]:
                print(f"  {t:8.3f} ms {n:5d}x  {name}")
            sys.stdout.flush()
        del model, kv
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
