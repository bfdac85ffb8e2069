"""Where a step's host time goes: the worker's runner (CUDA graphs on, as served) on the Qwen2-7B shape with
random bf16 weights launches a mixed step (decode rows + whole-prompt prefill chunks, as under continuous
batching at c256) and a decode step, each behind a long device sleep so the host never waits for the device.
Prints the host launch time, the device time, the number of kernels launched, and the Python functions the
launch spends its time in (cProfile, by own time and by cumulative time).

    python scripts/profile_step.py [--layers 28] [--decode-rows 256] [--chunks 3] [--chunk-len 1024]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import DummySource, load_from
from llaunch.runtime.worker.runner import ModelRunner

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="qwen2")
SPAN = 2048  # slots per row
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of device time: the launch never waits for the device


class Plans:
    """Step plans over rows with SPAN slots each; decode rows were prefilled with `context` tokens."""

    def __init__(self):
        self.step = 0
        self.len: dict[int, int] = {}
        self.greedy = SamplingParams(max_new_tokens=4096, temperature=0.0, ignore_eos=True)

    def _next(self, **kw) -> StepPlan:
        self.step += 1
        return StepPlan(step=self.step, **kw)

    def prefill(self, rows: list[int], n: int) -> StepPlan:
        new = [NewSeq(row=r, request_id=f"r{r}-{self.step}", sampling=self.greedy, prompt_ids=[11] * n) for r in rows]
        chunks = [PrefillChunk(row=r, token_ids=[11] * n, start=0, slots=list(range(r * SPAN, r * SPAN + n)), sample=True)
                  for r in rows]
        for r in rows:
            self.len[r] = n
        return self._next(new=new, prefill=chunks)

    def decode(self, rows: list[int], chunk_rows: list[int] = (), chunk_len: int = 0) -> StepPlan:
        slots = [r * SPAN + self.len[r] for r in rows]
        for r in rows:
            self.len[r] += 1
        mixed = self.prefill(list(chunk_rows), chunk_len) if chunk_rows else None
        self.step -= bool(mixed)
        return self._next(decode_rows=list(rows), decode_slots=slots, new=mixed.new if mixed else [],
                          prefill=mixed.prefill if mixed else [])


def profiled_launch(runner: ModelRunner, plan: StepPlan, profile: bool) -> tuple[float, float, int]:
    """(host launch ms, device ms, kernels launched) of one step behind a device sleep (the start event fires
    when the sleep ends: the step's kernels are all queued by then)."""
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = cProfile.Profile() if profile else None
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) if profile else _nothing() as tp:
        if cuda:
            start.record()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        pending = runner.launch(plan)
        if prof:
            prof.disable()
        host = time.perf_counter() - t0
        if cuda:
            end.record()
        runner.finish(pending)
    kernels = 0
    if profile:
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        kernels = sum(1 for e in tp.events() if e.device_type == kind)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
            print(f"--- cProfile by {key}\n" + s.getvalue()[-9000:])
    return host * 1e3, start.elapsed_time(end) if cuda else 0.0, kernels


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--decode-rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=512, help="tokens each decode row holds")
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--chunk-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mixed-graph-tokens", type=int, default=4096, help="the runner's (0: mixed steps eager)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (host times mean nothing there)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    arch = ModelArch.from_hf_config(dict(QWEN2_7B, num_hidden_layers=args.layers))
    model = DecoderLM(arch, TpGroup(0, 1, None), device, torch.float32 if args.cpu else torch.bfloat16, SPAN).eval()
    load_from(model, DummySource(0, device, full_tensors=False))
    rows = args.decode_rows + 2 * args.chunks * (args.repeats + 3)
    kv = model.make_kv_cache((rows + 1) * SPAN + 1, rows + 1, SPAN)
    t0 = time.perf_counter()
    runner = ModelRunner(model, kv, rows, device, cuda_graphs=True, prefill_graph_tokens=1024,
                         mixed_graph_tokens=args.mixed_graph_tokens)
    print(f"runner built (graphs captured) in {time.perf_counter() - t0:.1f}s", flush=True)
    plans = Plans()
    decode_rows = list(range(args.decode_rows))
    for i in range(0, len(decode_rows), 16):
        runner.execute(plans.prefill(decode_rows[i:i + 16], args.context))
    fresh = iter(range(args.decode_rows, rows))
    results = {}
    graphs = runner.mixed_graphs
    for kind in ("mixed", "mixed eager", "decode"):
        runner.mixed_graphs = None if kind == "mixed eager" else graphs
        host, device_ms = [], []
        for r in range(args.repeats + 2):  # a warm-up, the timed repeats, one under the profilers
            chunk_rows = [next(fresh) for _ in range(args.chunks)] if kind.startswith("mixed") else []
            plan = plans.decode(decode_rows, chunk_rows, args.chunk_len)
            h, d, kernels = profiled_launch(runner, plan, profile=(r == args.repeats + 1))
            if 0 < r <= args.repeats:
                host.append(h)
                device_ms.append(d)
        results[kind] = dict(host_ms=round(statistics.median(host), 2), host_ms_all=[round(h, 2) for h in host],
                             device_ms=round(statistics.median(device_ms), 2), kernels=kernels)
        print(json.dumps({"kind": kind, "decode_rows": args.decode_rows, "prefill_tokens":
                          args.chunks * args.chunk_len if kind.startswith("mixed") else 0, **results[kind]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
