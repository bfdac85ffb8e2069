"""Where a Qwen2-7B-shaped step's device time goes, by kernel (torch profiler): the decode step
replayed from its CUDA graph, and an eager prefill. `scripts/gpu_correctness.py --profile` runs both
after its checks. Under PDL the decode table overstates: an early-launched kernel counts its wait."""
from __future__ import annotations

import json

import torch

from gpu_correctness import batch_of, decode_args
from llaunch.runtime.worker.cuda_graphs import DecodeGraphs


def profile_decode_step(graphs: DecodeGraphs, kv, context: int = 1024, steps: int = 20) -> None:
    """Kernel time per decode step, by kernel name (torch profiler over graph replays), batch 1 and 256:
    where the step's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    for b in (1, 256):
        args = decode_args(kv, b, context)
        graphs.run(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                graphs.run(*args)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / steps, e.count / steps) for e in prof.key_averages()
                if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(json.dumps(dict(profile=f"decode step, batch {b}, context {context}", kernel_us_per_step=round(total, 1))))
        for name, us, calls in rows[:18]:
            print(json.dumps(dict(batch=b, kernel=name[:90], us_per_step=round(us, 1), calls_per_step=calls,
                                  share=round(us / total, 3))))


def profile_prefill(model, kv, ids, slots, steps: int = 5) -> None:
    """Where an eager prefill's device time goes: kernel time by kernel, and the matrix products by
    input shape (which linear layer each is), per prefill (torch profiler). The step here returns
    every position's logits, so its LM head (and a cast) covers all rows; a served prefill's
    takes only the last."""
    from torch.profiler import ProfilerActivity, profile

    n = len(ids)
    batch = batch_of(ids, list(range(n)), slots, [], [], prefill=0)
    with torch.inference_mode():
        model.forward(batch, kv)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(steps):
                model.forward(batch, kv)
            torch.cuda.synchronize()
    kernels = [(e.key, e.device_time_total / steps, e.count / steps) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    kernels.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in kernels)
    print(json.dumps(dict(profile=f"prefill, {n} tokens, eager", kernel_us_per_step=round(total, 1))))
    for name, us, calls in kernels[:14]:
        print(json.dumps(dict(kernel=name[:100], us_per_step=round(us, 1), calls_per_step=calls,
                              share=round(us / total, 3))))
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::mm", "aten::addmm") and e.device_time_total > 0:
            print(json.dumps(dict(op=e.key, shapes=str(e.input_shapes)[:80], us_per_step=round(e.device_time_total / steps, 1),
                                  calls_per_step=e.count / steps)))
