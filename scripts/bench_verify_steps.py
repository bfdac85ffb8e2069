"""The cost side of speculative decoding: a batch-1 verify step of k+1 tokens against a plain decode
step, both as the worker runs them (the decode CUDA graph; the verify CUDA graph of k+1 decode tokens
of one row, runtime/worker/verify_graphs.py), on the Qwen2-7B shape with random bf16 weights. The
target (issue #24): a verify step costs <= 1.15x a decode step for k <= 4, the weights being read
once for all k+1 tokens. Prints one JSON line per step with its time and its ratio to decode.

    python scripts/bench_steps.py --verify [--context 1024] [--max-k 4] [--skinny-rows 16]   (a GPU; --skinny-rows:
        the verify steps again with their linear layers through kernels/skinny_gemm.py)
    python scripts/bench_steps.py --verify --tiny                             (CPU smoke: a tiny model, eager)
    python scripts/bench_steps.py --verify --shape smollm2-spec --skinny-rows 16 --profile   (the model
        bench_spec.sh serves, its steps' kernels by device time: where a verify step's time goes)

Each figure is the wall time per step of `--repeats` steps launched back to back (host and device
overlapping as in the server), the median of 5 such runs; the forward only (the verdict's sampling
and the token copy are not in either figure).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import defaultdict

import torch

from llaunch.kernels import settings
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.memory import MAX_VERIFY_GRAPH_TOKENS
from llaunch.runtime.models.weights import DummySource, load_from
from llaunch.runtime.worker.verify_graphs import VerifySteps

# gpu_run.sh's spec cut of SmolLM2-135M (18 of its 30 blocks), the model scripts/bench_spec.sh serves: its steps are
# launch-bound (~0.6 ms a decode step for 0.2 GB of weights), unlike the Qwen2-7B shape's
SMOLLM2_SPEC = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=18,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)
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
    """Row 0 with context-1 cached tokens feeds n tokens (verify_graphs.verify_tokens' layout: ids, rows, positions,
    slots, lengths, chunk starts)."""
    pos = list(range(context - 1, context - 1 + n))
    return [[7] * n, [0] * n, pos, pos, [p + 1 for p in pos], [0] * n]


def print_kernels(label: str, fn, cuda: bool, top: int) -> None:
    """The step's kernels by device time (a replay under torch.profiler; on the CPU its top-level ops)."""
    from profile_kernels import kernel_table  # scripts/ is on the path of a script run

    table = kernel_table(fn, cuda)
    print(json.dumps(dict(profile=label, kernels_ms=round(sum(t for _, t, _ in table), 4),
                          launches=sum(n for _, _, n in table))))
    for name, t, n in table[:top]:
        print(f"  {t * 1e3:8.1f} us {n:4d}x  {name}")


def host_launches(model, device, context: int, k: int, repeats: int, top: int, graph_len: int) -> None:
    """The worker's side of a served batch-1 step (ModelRunner, as the server builds it: its graphs cover
    `graph_len` tokens a row, the model's context length unless model.graph_max_len_in_batch says less): the host
    launch (the step trace's launch column) of a decode step and of a verify step of k+1 tokens, each on a quiet
    device; then each step whole, launched and finished one after another as a c1 server without chained steps
    runs them (`runner_step`: the trace's device column less the overlap); the verify step's kernels by device time
    (the verdict and the copies beside the forward); and the verify launch's host ops by CPU time. The row's
    length is reset before each launch, so every step covers the same context."""
    from torch.profiler import ProfilerActivity, profile

    from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan, VerifyChunk
    from llaunch.runtime.worker.runner import ModelRunner

    graph_len = max(graph_len, context + k + 1)
    kv = model.make_kv_cache(graph_len + 1, 2, graph_len)  # row 1 and the last slot: the graphs' scratch
    # its verify graphs as a spec=ngram server captures them: buckets up to 64 rows (spec.max_batch) of k+1 tokens
    verify_tokens = min(64 * (k + 1), MAX_VERIFY_GRAPH_TOKENS)
    runner = ModelRunner(model, kv, 1, device, cuda_graphs=device.type == "cuda", verify_tokens=verify_tokens)
    print(json.dumps(dict(runner_graph_len=graph_len, verify_graph_tokens=verify_tokens)))
    prompt = [7] * (context - 1)
    runner.finish(runner.launch(StepPlan(step=0, new=[NewSeq(
        row=0, request_id="0", sampling=SamplingParams(max_new_tokens=1 << 20, temperature=0.0), prompt_ids=prompt)],
        prefill=[PrefillChunk(row=0, token_ids=prompt, start=0, slots=list(range(context - 1)), sample=True)])))
    plans = {"decode": lambda i: StepPlan(step=i, decode_rows=[0], decode_slots=[context - 1]),
             f"verify k={k}": lambda i: StepPlan(step=i, verify=[VerifyChunk(
                 row=0, token_ids=[7] * (k + 1), start=context - 1, slots=list(range(context - 1, context + k)))])}

    def launch(plan):
        runner.seq_len[0] = context - 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = runner.launch(plan)
        took = time.perf_counter() - t0
        runner.finish(pending)
        return took

    def whole(plan):
        runner.seq_len[0] = context - 1
        runner.finish(runner.launch(plan))

    step = 1
    for name, make in plans.items():
        times = []
        for _ in range(repeats + 3):
            times.append(launch(make(step)))
            step += 1
        print(json.dumps(dict(host_launch=name, ms=round(statistics.median(times[3:]) * 1e3, 4))))
    base = None
    for j in range(0, k + 1):
        plan = plans["decode"] if j == 0 else lambda i, j=j: StepPlan(step=i, verify=[VerifyChunk(
            row=0, token_ids=[7] * (j + 1), start=context - 1, slots=list(range(context - 1, context + j)))])
        counter = iter(range(step, step + 10 ** 6))
        ms = per_step_ms(lambda: whole(plan(next(counter))), repeats, device.type == "cuda")
        step += 10 ** 6
        base = base or ms
        print(json.dumps(dict(runner_step="decode" if j == 0 else f"verify k={j}", tokens=j + 1, ms=round(ms, 4),
                              ratio=round(ms / base, 3))))
    verify_plan = plans[f"verify k={k}"]
    print_kernels(f"runner verify k={k}", lambda: whole(verify_plan(step)), device.type == "cuda", top)
    step += 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        launch(plans[f"verify k={k}"](step))
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.cpu_parent is None:  # top-level: the runner's own torch ops and runtime calls
            totals[e.name[:90]] += e.cpu_time_total
            counts[e.name[:90]] += 1
    print(json.dumps(dict(host_profile=f"verify k={k}", ops=sum(counts.values()), us=round(sum(totals.values()), 1))))
    for name, us in sorted(totals.items(), key=lambda x: -x[1])[:top]:
        print(f"  {us:8.1f} us {counts[name]:4d}x  {name}")


def run_verify(shape: dict, layers: int, context: int, max_k: int, repeats: int, tiny: bool,
               skinny_rows: int = 0, profile_top: int = 0, graph_len: int = 0) -> int:
    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArch.from_hf_config(dict(TINY if tiny else shape, num_hidden_layers=2 if tiny else layers,
                                         model_type="qwen2" if tiny else shape.get("model_type", "qwen2")))
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
        plain = lambda: verify.run([[-1], [0], [context - 1], [context - 1], [context], [0]])  # noqa: E731
    base = per_step_ms(plain, repeats, cuda)
    where = dict(device=str(torch.cuda.get_device_name() if cuda else "cpu"), dtype=str(dtype).split(".")[-1],
                 layers=arch.num_hidden_layers, context=context, graphs=cuda)
    print(json.dumps(dict(step="decode", k=0, tokens=1, ms=round(base, 4), ratio=1.0, **where)))
    if profile_top:
        print_kernels("decode", plain, cuda, profile_top)
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
        if profile_top:
            tokens = step_tokens(max_k + 1, context)
            print_kernels(f"verify k={max_k} skinny_rows={rows}", lambda: verify.run(tokens), cuda, profile_top)
        print(json.dumps(dict(step="summary", skinny_rows=rows, worst_verify_ratio=round(worst, 3), target=1.15,
                              met=worst <= 1.15)))
    if profile_top:
        del verify
        del kv
        host_launches(model, device, context, max_k, repeats, profile_top, graph_len or shape["max_position_embeddings"])
    return 0
