"""Device time of the forward steps the router composes, on the Qwen2-7B shape with random bf16
weights: decode batches, prefill chunks made of whole 1024-token prompts, and mixed steps (a decode
batch plus prefill chunks, as under continuous batching). Eager forward (no CUDA graph), timed with
CUDA events, median of repeats; prints one JSON line per step shape with its matmul TFLOP/s.

    python scripts/bench_steps.py [--layers N] [--prompt-len 1024]
    python scripts/bench_steps.py --verify [--context 1024] [--max-k 4] [--tiny] [--set KEY=VALUE]  (speculative
        decoding's verify steps against a decode step, with CUDA graphs: scripts/bench_verify_steps.py)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.batch import ForwardBatch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import DummySource, load_from

# conf/model/qwen2-7b.yaml's architecture (the benchmark model)
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)

SPAN = 2048  # slots per row


def step_batch(decode: int, context: int, prompts: int, prompt_len: int, device, prefix: int = 0,
               span: int = None) -> ForwardBatch:
    """`decode` rows with `context` cached tokens each decode one token; `prompts` prompts of `prompt_len` tokens
    prefill after `prefix` cached tokens of theirs (rows after the decode rows; `span` slots a row, SPAN unless
    given)."""
    span = span or SPAN
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    d_rows = list(range(decode))
    ids = [7] * decode
    pos = [context - 1] * decode
    slots = [r * span + context - 1 for r in d_rows]
    p_rows = list(range(decode, decode + prompts))
    starts, lens, last = [], [], list(range(decode))
    for r in p_rows:
        starts.append(len(ids))
        ids += [11] * prompt_len
        pos += range(prefix, prefix + prompt_len)
        slots += range(r * span + prefix, r * span + prefix + prompt_len)
        lens.append(prompt_len)
        last.append(len(ids) - 1)
    return ForwardBatch(t(ids), t(pos), t(slots), t(d_rows), t([context] * decode), t(p_rows), t(starts), t(lens),
                        t([prefix] * prompts), t(last), decode, prompts * prompt_len, prompt_len if prompts else 0,
                        context if decode else 0)


def time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--verify", action="store_true", help="time batch-1 verify steps (k=1..max-k) against decode")
    ap.add_argument("--context", type=int, default=1024, help="--verify: the row's cached tokens")
    ap.add_argument("--max-k", type=int, default=4, help="--verify: the most proposed tokens timed")
    ap.add_argument("--tiny", action="store_true", help="--verify: a tiny model on the CPU (a smoke run)")
    ap.add_argument("--shape", choices=("qwen2-7b", "smollm2-spec"), default="qwen2-7b",
                    help="--verify: the model's shape (smollm2-spec: bench_spec.sh's SmolLM2 cut, all its 18 layers)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="--verify: after the timings, the decode and the largest verify step's TOP kernels by device time")
    ap.add_argument("--graph-len", type=int, default=0,
                    help="--verify --profile: the served runner's graph length (0: the shape's context length, as served)")
    ap.add_argument("--skinny-rows", type=int, default=0,
                    help="--verify: the verify steps again with kernels.skinny_rows at this (the 2-16-row GEMM)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="--verify: a kernels setting for every step (kernels/settings.py), e.g. --set row_invariant=true")
    args = ap.parse_args()
    if args.verify:
        from bench_verify_steps import SMOLLM2_SPEC, run_verify  # scripts/ is on the path of a script run
        from profile_kernels import apply_settings

        apply_settings(args.set)

        shape = SMOLLM2_SPEC if args.shape == "smollm2-spec" else QWEN2_7B
        layers = shape["num_hidden_layers"] if args.shape == "smollm2-spec" else args.layers
        return run_verify(shape, layers, args.context, args.max_k, max(args.repeats, 20), args.tiny,
                          args.skinny_rows, args.profile, args.graph_len)
    device = torch.device("cuda")
    arch = ModelArch.from_hf_config(dict(QWEN2_7B, num_hidden_layers=args.layers, model_type="qwen2"))
    model = DecoderLM(arch, TpGroup(0, 1, None), device, torch.bfloat16, 4096).eval()
    load_from(model, DummySource(0, device, full_tensors=False))
    rows = 512
    kv = model.make_kv_cache(rows * SPAN + 1, rows + 1, SPAN)
    kv.req_to_slots[:rows] = torch.arange(rows * SPAN, dtype=torch.int32, device=device).view(rows, SPAN)
    flop_per_token = 2 * (arch.num_params - arch.vocab_size * arch.hidden_size)  # embedding lookup is free
    n = args.prompt_len
    shapes = [(1, 0), (64, 0), (256, 0), (0, 2), (0, 4), (0, 8), (64, 4), (256, 4), (256, 7), (128, 7)]
    for decode, prompts in shapes:
        batch = step_batch(decode, 1024, prompts, n, device)
        with torch.inference_mode():
            ms = time_ms(lambda: model.forward(batch, kv), args.repeats)
        tokens = decode + prompts * n
        print(json.dumps(dict(decode_rows=decode, decode_context=1024 if decode else 0, prefill_tokens=prompts * n,
                              ms=round(ms, 3), linear_tflops=round(flop_per_token * tokens / ms / 1e9, 1),
                              ms_per_prefill_token_k=round(ms / (prompts * n) * 1000, 3) if prompts else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
