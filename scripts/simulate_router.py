"""The router's scheduler under a closed-loop benchmark, on a CPU: which router settings to measure on a GPU.

The real Scheduler (runtime/router/scheduler.py) plans every step; a step's time comes from a linear model
of the GPU (a fixed cost, per decode row, per prefill token; the defaults fit the Qwen2-7B shape on one H200
in docs/performance.md: a batch-1 step 3.69 ms, 256 decode rows 8.12 ms, 256 rows + 3,072 prefill tokens
62 ms). `--concurrency` clients each send a new request as theirs finishes, as scripts/bench_serving.py does.
Printed per setting: output tok/s, the mean decode rows a step, TTFT median / p99, steps. The model's
absolute figures are optimistic (no host time, no attention growth); compare settings with each other.

    python scripts/simulate_router.py --concurrency 256 --prompts 1024 --settings 8192:6 8192:0 4096:6

A setting is batch_max_tokens:max_wait_tokens (router.*). What it showed (c256, 1,024 in / 256 out): with a
4,096-token step budget and max_wait_tokens 6, admissions (4 prompts every 7 steps) cap the running rows near
170 of 256, the TTFT median near 2.4 s.
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections import deque

from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, StepResult
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits


def simulate(args, batch_max_tokens: int, max_wait_tokens: int) -> dict:
    sched = Scheduler(SchedulerLimits(
        kv_slots=args.kv_slots, max_running=args.max_running, batch_max_tokens=batch_max_tokens,
        chunked_prefill=True, chunked_prefill_size=args.chunked_prefill_size, max_wait_tokens=max_wait_tokens,
        token_ratio=0.0, max_model_len=args.input_len + args.output_len + 1, eos_ids=(), pipeline_depth=2,
        spec=None))
    rng = random.Random(args.seed)
    sent, now, out_tokens = 0, 0.0, 0
    sent_at: dict[str, float] = {}
    ttft: dict[str, float] = {}
    e2e: dict[str, float] = {}

    def send() -> None:
        nonlocal sent
        sp = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        prompt = [rng.randrange(3, 50000) for _ in range(args.input_len)]
        sched.add(Request(AddRequest(str(sent), 0, prompt, sp, 0.0), sp))
        sent_at[str(sent)] = now
        sent += 1

    for _ in range(min(args.concurrency, args.prompts)):
        send()
    pending: deque = deque()
    rows_per_step = []
    while sched.has_work() or pending:
        while len(pending) < 2:  # the router keeps two steps in flight
            plan = sched.schedule()
            if plan is None:
                break
            pending.append(plan)
        if not pending:
            break
        plan = pending.popleft()
        prefill_tokens = sum(len(c.token_ids) for c in plan.prefill)
        now += args.step_ms + args.row_ms * len(plan.decode_rows) + args.prefill_token_ms * prefill_tokens
        rows_per_step.append(len(plan.decode_rows))
        rows = list(plan.decode_rows) + [c.row for c in plan.prefill if c.sample]
        for delta in sched.on_result(StepResult(step=plan.step, rows=rows, token_ids=[5] * len(rows))):
            if delta.token_ids and delta.request_id not in ttft:
                ttft[delta.request_id] = now - sent_at[delta.request_id]
            out_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                e2e[delta.request_id] = now - sent_at[delta.request_id]
                if sent < args.prompts:
                    send()
    firsts, ends = sorted(ttft.values()), sorted(e2e.values())
    pct = lambda xs, q: xs[min(len(xs) - 1, int(len(xs) * q))]  # noqa: E731
    return dict(tok_s=out_tokens / now * 1e3, rows=statistics.mean(rows_per_step), ttft_med=pct(firsts, 0.5),
                ttft_p99=pct(firsts, 0.99), e2e_med=pct(ends, 0.5), e2e_p99=pct(ends, 0.99), steps=len(rows_per_step))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=["8192:6", "8192:0"], help="batch_max_tokens:max_wait_tokens")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256, help="router.max_running_requests")
    p.add_argument("--chunked-prefill-size", type=int, default=4096)
    p.add_argument("--kv-slots", type=int, default=600_000)
    p.add_argument("--step-ms", type=float, default=3.5, help="a step's fixed cost")
    p.add_argument("--row-ms", type=float, default=0.018, help="per decode row")
    p.add_argument("--prefill-token-ms", type=float, default=0.0175, help="per prefill token")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for setting in args.settings:
        budget, wait = (int(x) for x in setting.split(":"))
        r = simulate(args, budget, wait)
        print(f"batch_max_tokens {budget:6} max_wait_tokens {wait:2}: {r['tok_s']:8.0f} out tok/s, "
              f"{r['rows']:6.1f} decode rows a step, TTFT median {r['ttft_med']:6.0f} ms / p99 {r['ttft_p99']:6.0f} ms, "
              f"E2E median {r['e2e_med']:6.0f} ms / p99 {r['e2e_p99']:6.0f} ms, {r['steps']} steps")


if __name__ == "__main__":
    main()
