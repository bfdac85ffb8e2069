"""The cost side of speculative decoding: a batch-1 verify step of k+1 tokens against a plain decode
step, both as the worker runs them (the decode CUDA graph; the verify CUDA graph of k+1 decode tokens
of one row, runtime/worker/verify_graphs.py), on the Qwen2-7B shape with random bf16 weights. The
target (issue #24): a verify step costs <= 1.15x a decode step for k <= 4, the weights being read
once for all k+1 tokens. Prints one JSON line per step with its time and its ratio to decode.

    python scripts/bench_steps.py --verify [--context 1024] [--max-k 4] [--skinny-rows 16]   (a GPU; --skinny-rows:
        the verify steps again with their linear layers through kernels/skinny_gemm.py)
    python scripts/bench_steps.py --verify --tiny                             (CPU smoke: a tiny model, eager)

Each figure is the wall time per step of `--repeats` steps launched back to back (host and device
overlapping as in the server), the median of 5 such runs; the forward only (the verdict's sampling
and the token copy are not in either figure).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from llaunch.kernels import settings
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import DummySource, load_from
from llaunch.runtime.worker.verify_graphs import VerifySteps

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=4096, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True)


def per_step_ms(fn, repeats: int, cuda: bool) -> float:
    def run() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats * 1e3

    run()  # warm-up
    return statistics.median(run() for _ in range(5))


def step_tokens(n: int, context: int) -> list[list[int]]:
    """Row 0 with context-1 cached tokens feeds n tokens (ids, rows, positions, slots, lengths)."""
    pos = list(range(context - 1, context - 1 + n))
    return [[7] * n, [0] * n, pos, pos, [p + 1 for p in pos]]


def run_verify(shape: dict, layers: int, context: int, max_k: int, repeats: int, tiny: bool,
               skinny_rows: int = 0) -> int:
    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArch.from_hf_config(dict(TINY if tiny else shape, num_hidden_layers=2 if tiny else layers,
                                         model_type="qwen2"))
    span = context + max_k + 8
    model = DecoderLM(arch, TpGroup(0, 1, None), device, dtype, span).eval()
    load_from(model, DummySource(0, device, full_tensors=False))
    kv = model.make_kv_cache(span + 1, 2, span)  # row 1 and slot `span`: the graphs' scratch
    kv.req_to_slots[0] = torch.arange(span, dtype=torch.int32, device=device)
    kv.req_to_slots[1].fill_(span)
    last_token = torch.full((2,), 7, dtype=torch.int64, device=device)
    verify = VerifySteps(model, kv, last_token, max_k + 1, span, scratch_row=1, scratch_slot=span)
    if cuda:
        from llaunch.runtime.worker.cuda_graphs import DecodeGraphs

        decode = DecodeGraphs(model, kv, last_token, 1, span, scratch_row=1, scratch_slot=span)
        decode.capture()
        verify.capture()
        plain = lambda: decode.run([0], [context - 1], [context - 1], [context])  # noqa: E731
    else:  # no graphs: the same one-token step, eager
        plain = lambda: verify.run([[-1], [0], [context - 1], [context - 1], [context]])  # noqa: E731
    base = per_step_ms(plain, repeats, cuda)
    where = dict(device=str(torch.cuda.get_device_name() if cuda else "cpu"), dtype=str(dtype).split(".")[-1],
                 layers=arch.num_hidden_layers, context=context, graphs=cuda)
    print(json.dumps(dict(step="decode", k=0, tokens=1, ms=round(base, 4), ratio=1.0, **where)))
    for rows in [0] + ([skinny_rows] if skinny_rows else []):  # cuBLAS, then the skinny GEMM (kernels.skinny_rows)
        if rows:
            settings.configure(dataclasses.replace(settings.current.settings, skinny_rows=rows))
            del verify
            verify = VerifySteps(model, kv, last_token, max_k + 1, span, scratch_row=1, scratch_slot=span)
            if cuda:
                verify.capture()
        worst = 0.0
        for k in range(1, max_k + 1):
            tokens = step_tokens(k + 1, context)
            ms = per_step_ms(lambda: verify.run(tokens), repeats, cuda)
            worst = max(worst, ms / base)
            print(json.dumps(dict(step="verify", k=k, tokens=k + 1, skinny_rows=rows, ms=round(ms, 4),
                                  ratio=round(ms / base, 3), **where)))
        print(json.dumps(dict(step="summary", skinny_rows=rows, worst_verify_ratio=round(worst, 3), target=1.15,
                              met=worst <= 1.15)))
    return 0
