"""Launch shapes for the fused MoE layer's two grouped GEMMs (kernels/fused_moe.py), per step size, printed as a
`kernels.moe_shapes` value. For each token count the whole `fused_moe` call (align, gate‖up, down, the sum) is timed
under each candidate MoeLaunch, set through kernels.moe_shapes as the worker would, and under the default launch
(no moe_shapes). Inputs as a model step sees them: random x, random router logits through `moe_route` (top-k,
renormalized), so pairs spread over the experts as a router spreads them; --copies distinct weight sets are used in
turn, so weights come from memory, not L2. Every candidate's first output is checked against kernels/reference.py's
fused_moe (cosine ≥ 0.999; float32: relative error ≤ 1e-4): a wrong one stops the run.

Each candidate compiles two Triton kernels (about a second each): --compile-workers processes compile every
candidate first, into Triton's on-disk cache, so the timed sweep loads them. --budget-s bounds the whole run: once
spent, no further candidate is tried (token counts with none tried are left to the default launch) and the run
says so on stderr.

Output: one JSON line per token count, {tokens, pairs, experts_touched, default_us, best_us, best, default_tbps,
best_tbps, candidates (the list's size), skipped (refused by the compiler or out of resources), untried (cut by the
budget)}, microseconds the median of --iters calls timed one by one with CUDA events (a spin kernel holds the stream
while the host queues them, so host launch gaps stay out), TB/s the weights of the experts the step touches over that
time; then `moe_shapes: ExIxH@T=...,...,ExIxH=...`, each entry the winner (default included) up to that token count,
the largest the unbounded one. Progress goes to stderr.

    python scripts/tune_moe.py [--experts 128 --inter 768 --hidden 2048 --top-k 8] [--tokens 1 2 4 ...]
        [--budget-s 240] [--out moe_shapes.txt]
    python scripts/tune_moe.py --cpu   (a smoke run under TRITON_INTERPRET=1: a tiny shape, two candidates, float32)
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--cpu" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run in its interpreter

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import random
import statistics
import time
from typing import Optional

import torch
import triton

from llaunch.kernels import reference, settings
from llaunch.kernels.fused_moe import default_launch, fused_moe, moe_route
from llaunch.kernels.settings import MoeLaunch, parse_moe_shapes

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SMEM_LIMIT = 220 * 1024  # bytes of shared memory a launch's stages may take (an H200 SM has 228 KB)
SEED = 0


@dataclasses.dataclass(frozen=True)
class Layer:
    experts: int
    inter: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    device: str

    @property
    def key(self) -> str:
        return f"{self.experts}x{self.inter}x{self.hidden}"

    def weight_bytes(self, experts: int) -> int:
        """Bytes of w13 and w2 of that many experts."""
        return experts * 3 * self.inter * self.hidden * torch.finfo(self.dtype).bits // 8


def candidates(tokens: int, layer: Layer) -> list[MoeLaunch]:
    """A grid pruned to what can win: the pairs' GEMVs where pairs are few; row tiles near the pairs an expert gets, no tile past the shared memory or
    the registers (8 warps for wide tiles only, 4 for narrow ones), GROUP_M 8 only where an expert has several row
    tiles. At most ~150 a token count."""
    per_expert = math.ceil(tokens * layer.top_k / layer.experts)
    most_m = min(128, 2 * max(16, triton.next_power_of_2(per_expert)))
    found = []
    for bm, bn, bk, warps, stages, group in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (64, 128, 256),
                                                              (4, 8), (2, 3, 4), (1, 8)):
        tile = bm * bn
        if not most_m // 4 <= bm <= most_m or tile > 128 * 256:
            continue
        if stages * (bm * bk + 2 * bk * bn) * 2 > SMEM_LIMIT:  # gate‖up's stage: an x tile and two weight tiles
            continue
        if (warps == 8 and tile < 64 * 128) or (warps == 4 and tile > 64 * 128) or (group > 1 and per_expert <= bm):
            continue
        found.append(MoeLaunch(bm, bn, bk, warps, stages, group))
    if tokens * layer.top_k <= 64:  # few pairs: each its own GEMVs (BLOCK_M 1), BLOCK_N rows a program
        # (the down GEMV sums a token's k experts in one program: its tile is k x BLOCK_N/k x BLOCK_K)
        found += [MoeLaunch(1, bn, bk, warps, 1, 1) for bn, bk, warps in itertools.product((4, 8, 16, 32),
                                                                                            (128, 256, 512, 1024), (4, 8))
                  if (warps == 8) == (bn * bk >= 4096)]
    return found


def launch_text(launch: MoeLaunch) -> str:
    return "/".join(str(v) for v in launch)


def shapes_text(layer: Layer, winners: list[tuple[int, MoeLaunch]], unbounded: bool) -> str:
    """moe_shapes for winners [(token count, launch)] ascending: a run of one launch collapses into its largest
    bound; the last entry has no bound when `unbounded`."""
    entries: list[tuple[int, MoeLaunch]] = []
    for tokens, launch in winners:
        if entries and entries[-1][1] == launch:
            entries.pop()
        entries.append((tokens, launch))
    return ",".join(f"{layer.key}{'' if unbounded and n == len(entries) - 1 else f'@{tokens}'}={launch_text(launch)}"
                    for n, (tokens, launch) in enumerate(entries))


def expert_weights(layer: Layer, copies: int, fill: bool = True) -> tuple[list, list]:
    """`copies` sets of w13 [E, 2I, H] and w2 [E, H, I] scaled so every product is O(1); zeros when not `fill`."""
    make = torch.randn if fill else torch.zeros
    kw = dict(dtype=layer.dtype, device=layer.device)
    w13 = [make(layer.experts, 2 * layer.inter, layer.hidden, **kw).mul_(layer.hidden ** -0.5) for _ in range(copies)]
    w2 = [make(layer.experts, layer.hidden, layer.inter, **kw).mul_(layer.inter ** -0.5) for _ in range(copies)]
    return w13, w2


def step_inputs(layer: Layer, tokens: int):
    """x [T, H] and the router's choice for it: (x, weights [T, k], ids [T, k]), the same for a token count in
    every process."""
    gen = torch.Generator(device=layer.device).manual_seed(SEED + tokens)
    x = torch.randn(tokens, layer.hidden, generator=gen, device=layer.device).to(layer.dtype)
    logits = torch.randn(tokens, layer.experts, generator=gen, device=layer.device)
    return (x, *moe_route(logits, layer.top_k, renormalize=True))


def configured(before: settings.KernelSettings, layer: Layer, launch: Optional[MoeLaunch]) -> None:
    """Every step of this layer shape launches `launch`; None: the default launch."""
    shapes = f"{layer.key}={launch_text(launch)}" if launch else ""
    settings.configure(dataclasses.replace(before, moe_shapes=shapes))


# ---- compiling every candidate first, in worker processes ----------------------------------------------------------

_worker: dict = {}


def _worker_setup(layer: Layer) -> None:
    try:
        _worker["weights"] = expert_weights(layer, 1, fill=False)  # shapes and strides are what compiles read
        _worker["layer"], _worker["inputs"] = layer, {}
    except Exception as e:  # a failing initializer would be restarted by the pool forever: report it per job
        _worker["error"] = f"{type(e).__name__}: {e}"


def _worker_compile(job: tuple[MoeLaunch, list[int]]) -> Optional[str]:
    """Run the layer once per token count under this launch, which compiles its kernels into the on-disk cache."""
    if "error" in _worker:
        return _worker["error"]
    launch, token_counts = job
    layer = _worker["layer"]
    configured(settings.current.settings, layer, launch)
    for tokens in token_counts:
        if tokens not in _worker["inputs"]:
            _worker["inputs"][tokens] = step_inputs(layer, tokens)
        inputs = _worker["inputs"][tokens]
        try:
            fused_moe(inputs[0], _worker["weights"][0][0], _worker["weights"][1][0], *inputs[1:])
        except Exception:  # refused launches are counted in the sweep
            pass
    if layer.device == "cuda":
        torch.cuda.synchronize()
    return None


def precompile(layer: Layer, plans: dict[int, list[MoeLaunch]], workers: int, deadline: float) -> None:
    """Each candidate once for all its token counts, spread over `workers` processes until `deadline`."""
    jobs: dict[MoeLaunch, list[int]] = {}
    for tokens, plan in plans.items():
        for launch in dict.fromkeys((default_launch(tokens, layer.experts, layer.top_k), *plan)):
            jobs.setdefault(launch, []).append(tokens)
    if not jobs or workers < 1:
        return
    began = time.monotonic()
    print(f"# compiling {len(jobs)} launches in {workers} processes", file=sys.stderr, flush=True)
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_setup, initargs=(layer,))
    except (OSError, RuntimeError) as e:
        print(f"# no compiling workers ({e}); the sweep compiles", file=sys.stderr, flush=True)
        return
    try:
        done = pool.imap_unordered(_worker_compile, jobs.items())
        for n in range(1, len(jobs) + 1):
            try:
                error = done.next(timeout=max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                print(f"# compiling stopped at its share of the budget: {n - 1} of {len(jobs)} done; the sweep "
                      "compiles the rest", file=sys.stderr, flush=True)
                return
            if error:
                print(f"# compiling in workers failed ({error}); the sweep compiles", file=sys.stderr, flush=True)
                return
            if n % max(1, len(jobs) // 10) == 0 or n == len(jobs):
                print(f"#   {n}/{len(jobs)} compiled, {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    finally:
        pool.terminate()  # ends the workers, and any run still in flight, before anything is timed
        pool.join()


# ---- the sweep ----------------------------------------------------------------------------------------------------

class Timer:
    """Median microseconds of `iters` calls, each timed alone. On a GPU: CUDA events around each call, after a spin
    kernel that holds the stream while the host queues them all, so align's many small launches leave no gaps."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spin_s = 0.005  # grows to 1.5× the longest host queueing seen

    def median_us(self, call, iters: int) -> float:
        if not self.cuda:
            times = []
            for i in range(iters):
                began = time.perf_counter()
                call(i)
                times.append((time.perf_counter() - began) * 1e6)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(int(self.spin_s * 2e9))  # cycles at about an H200's 2 GHz
        queued = time.perf_counter()
        for i, (start, end) in enumerate(zip(starts, ends)):
            start.record()
            call(i)
            end.record()
        self.spin_s = min(0.1, max(self.spin_s, 1.5 * (time.perf_counter() - queued)))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends))


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exit loudly where `got` is not the reference's output."""
    g, w = got.double().flatten(), want.double().flatten()
    cosine = (g @ w / (g.norm() * w.norm()).clamp_min(1e-30)).item()
    rel = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    if not (cosine >= 0.999 and (got.dtype != torch.float32 or rel <= 1e-4)):
        sys.exit(f"tune_moe: {what}: output differs from kernels/reference.py's (cosine {cosine:.6f}, "
                 f"relative error {rel:.2e}): a kernel bug, no launch shapes written")


def tbps(layer: Layer, touched: int, us: Optional[float]) -> Optional[float]:
    return None if us is None else round(layer.weight_bytes(touched) / (us * 1e-6) / 1e12, 3)


def sweep(layer: Layer, tokens: int, plan: list[MoeLaunch], weights: tuple[list, list], timer: Timer, iters: int,
          deadline: float) -> tuple[dict, Optional[MoeLaunch]]:
    """The JSON row of one token count and its winner (None when the budget left no candidate tried)."""
    before = settings.current.settings
    x, topk_weights, ids = step_inputs(layer, tokens)
    w13, w2 = weights
    want = reference.fused_moe(x, w13[0], w2[0], topk_weights, ids)

    def call(i: int) -> torch.Tensor:
        return fused_moe(x, w13[i % len(w13)], w2[i % len(w2)], topk_weights, ids)

    def measure(launch: Optional[MoeLaunch]) -> float:
        configured(before, layer, launch)
        try:
            check(call(0), want, f"T={tokens} {launch_text(launch) if launch else 'default launch'}")  # compiles
            return timer.median_us(call, iters)
        finally:
            settings.configure(before)

    default_us = measure(None)
    times: dict[MoeLaunch, float] = {}
    skipped = untried = 0
    for n, launch in enumerate(plan):
        if time.monotonic() > deadline:
            untried = len(plan) - n
            break
        try:
            times[launch] = measure(launch)
        except Exception:  # the compiler refused it, or its shared memory does not fit
            if layer.device == "cuda":
                torch.cuda.synchronize()  # a fault that broke the context raises again here: stop
            skipped += 1
    winner = best_us = None
    if times:
        winner, best_us = min(times.items(), key=lambda item: item[1])
        if default_us <= best_us:
            winner, best_us = default_launch(tokens, layer.experts, layer.top_k), default_us
    touched = ids.unique().numel()
    row = dict(tokens=tokens, pairs=ids.numel(), experts_touched=touched, default_us=round(default_us, 2),
               best_us=None if best_us is None else round(best_us, 2), best=winner and launch_text(winner),
               default_tbps=tbps(layer, touched, default_us), best_tbps=tbps(layer, touched, best_us),
               candidates=len(plan), skipped=skipped, untried=untried)
    return row, winner


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--experts", type=int, default=128, help="experts on the rank (Qwen3-30B-A3B at tp1: 128)")
    ap.add_argument("--inter", type=int, default=768, help="an expert's intermediate columns on the rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="step sizes to tune, each a bound")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--copies", type=int, default=4, help="weight sets used in turn (L2 holds ~60 MB; one set of "
                    "the default shape is 1.2 GB)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per launch (their median)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall seconds for the whole run; half at most "
                    "for compiling in workers")
    ap.add_argument("--compile-workers", type=int, default=None, help="processes compiling the candidates first "
                    "(default min(16, CPUs); 0: the sweep compiles each as it comes)")
    ap.add_argument("--out", help="also write the moe_shapes value to this file")
    ap.add_argument("--keep-bounds", action="store_true", help="the largest token count's entry keeps its bound too "
                    "(entries to put before another run's for larger steps)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run under TRITON_INTERPRET=1: experts 8, inter 32, "
                    "hidden 64, top-k 2, tokens 1 4, two candidates, float32")
    args = ap.parse_args(argv)
    if args.cpu:
        args.experts, args.inter, args.hidden, args.top_k, args.tokens = 8, 32, 64, 2, [1, 4]
        args.dtype, args.copies, args.iters = "float32", 2, 2
        args.compile_workers = 2 if args.compile_workers is None else args.compile_workers  # the pool's path, too
    elif args.compile_workers is None:
        args.compile_workers = min(16, os.cpu_count() or 1)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    deadline = began + args.budget_s
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("tune_moe: no CUDA device (--cpu runs a smoke test in the interpreter)")
    layer = Layer(args.experts, args.inter, args.hidden, args.top_k, getattr(torch, args.dtype),
                  "cpu" if args.cpu else "cuda")
    token_counts = sorted(set(args.tokens))
    plans = {}
    for tokens in token_counts:
        plan = candidates(tokens, layer)
        if args.cpu:
            plan = [plan[0], plan[-1]]  # the narrowest and the widest tile: two paddings, two grids
        random.Random(tokens).shuffle(plan)  # a sweep cut by the budget has still tried all kinds of tile
        plans[tokens] = plan
    precompile(layer, plans, args.compile_workers, began + args.budget_s / 2)
    torch.manual_seed(SEED)
    weights = expert_weights(layer, args.copies)
    timer = Timer(layer.device == "cuda")
    winners, cut = [], False
    for tokens in token_counts:
        print(f"# T={tokens}: {len(plans[tokens])} candidates, {time.monotonic() - began:.0f} s in",
              file=sys.stderr, flush=True)
        row, winner = sweep(layer, tokens, plans[tokens], weights, timer, args.iters, deadline)
        print(json.dumps(row), flush=True)
        if row["untried"] and not cut:
            cut = True
            print(f"# budget of {args.budget_s:.0f} s spent at T={tokens} ({row['untried']} of its candidates "
                  "untried): from here on only the default launch is timed, and token counts with nothing tried "
                  "are left to it (raise --budget-s to sweep them)", file=sys.stderr, flush=True)
        if winner is not None:
            winners.append((tokens, winner))
    text = shapes_text(layer, winners, unbounded=bool(winners) and winners[-1][0] == token_counts[-1]
                       and not args.keep_bounds)
    parse_moe_shapes(text)  # what kernels.moe_shapes takes
    print(f"moe_shapes: {text}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"# done in {time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
