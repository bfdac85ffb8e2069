#!/usr/bin/env python
"""Workloads shaped like real traffic for scripts/bench_serving.py: a recorded trace replayed (arrival
times, prompt and output lengths), or ShareGPT-like lengths drawn when no trace exists. As a script it
writes such a trace, to edit or to replay later:

    python scripts/bench_trace.py --num 1000 --rate 4 --input-len 256 --output-len 200 --out trace.jsonl

A trace is JSONL, one request a line: {"arrival_s": 0.25, "input_len": 310, "output_len": 42}
(seconds from any origin, prompt tokens, tokens to generate). Mooncake's field names are read too:
{"timestamp": <ms>, "input_length": ..., "output_length": ...}.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

# ShareGPT's lengths are roughly log-normal with a long right tail (vLLM's filtered ShareGPT set:
# prompts median ≈ 0.45 × mean, outputs ≈ 0.6 × mean); sigma gives that median/mean ratio: exp(-sigma²/2).
SHAREGPT_SIGMA_INPUT = 1.25
SHAREGPT_SIGMA_OUTPUT = 1.0
MAX_OVER_MEAN = 16  # the tail is cut at 16 × the mean (ShareGPT has no unbounded conversations)


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    input_len: int
    output_len: int


def _record(line: dict, where: str) -> TraceRecord:
    try:
        if "arrival_s" in line:
            arrival = float(line["arrival_s"])
        else:
            arrival = float(line["timestamp"]) / 1000.0  # Mooncake: milliseconds
        inp = int(line["input_len"] if "input_len" in line else line["input_length"])
        out = int(line["output_len"] if "output_len" in line else line["output_length"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: a request needs arrival_s, input_len and output_len ({e!r})") from None
    if inp < 1 or out < 1 or not math.isfinite(arrival):
        raise ValueError(f"{where}: input_len and output_len must be >= 1 and arrival_s finite")
    return TraceRecord(arrival, inp, out)


def read_trace(path: str | Path) -> list[TraceRecord]:
    """The trace's requests in arrival order; a malformed line fails with its line number."""
    records = []
    for n, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        records.append(_record(line, f"{path}:{n}"))
    if not records:
        raise ValueError(f"{path}: the trace holds no requests")
    return sorted(records, key=lambda r: r.arrival_s)


def trace_workload(records: Sequence[TraceRecord], num: int) -> tuple[list[int], list[int], list[float]]:
    """The first `num` requests: input lengths, output lengths and send times from the first arrival."""
    kept = list(records[:num])
    t0 = kept[0].arrival_s
    return [r.input_len for r in kept], [r.output_len for r in kept], [r.arrival_s - t0 for r in kept]


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, num: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # the log-normal's mean is exp(mu + sigma²/2)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=num)), 1, max(1, MAX_OVER_MEAN * mean)).astype(int)


def sharegpt_lengths(num: int, mean_input: int, mean_output: int, seed: int,
                     max_model_len: Optional[int] = None) -> tuple[list[int], list[int]]:
    """ShareGPT-like (log-normal) prompt and output lengths around these means; a pair longer than
    max_model_len loses prompt tokens first (the server would refuse it)."""
    rng = np.random.default_rng(seed)
    inputs = _lognormal(rng, mean_input, SHAREGPT_SIGMA_INPUT, num)
    outputs = _lognormal(rng, mean_output, SHAREGPT_SIGMA_OUTPUT, num)
    if max_model_len:
        outputs = np.minimum(outputs, max(1, max_model_len // 2))
        inputs = np.maximum(1, np.minimum(inputs, max_model_len - outputs))
    return inputs.tolist(), outputs.tolist()


def prompts_of_lengths(lengths: Sequence[int], vocab_size: int, seed: int, low: int = 100) -> list[list[int]]:
    """One prompt of random token ids in [low, vocab_size) per length."""
    if vocab_size <= low:
        raise ValueError(f"--vocab-size {vocab_size} must exceed {low}")
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, size=n).tolist() for n in lengths]


def write_trace(path: str | Path, num: int, rate: float, mean_input: int, mean_output: int, seed: int) -> None:
    """A synthetic trace: Poisson arrivals at `rate` req/s and ShareGPT-like lengths."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num) if rate > 0 and math.isfinite(rate) else np.zeros(num)
    gaps[0] = 0.0
    inputs, outputs = sharegpt_lengths(num, mean_input, mean_output, seed + 1)
    with open(path, "w") as f:
        for t, i, o in zip(np.cumsum(gaps).tolist(), inputs, outputs):
            f.write(json.dumps({"arrival_s": round(t, 6), "input_len": i, "output_len": o}) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=1000, help="requests")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals, req/s (inf: all at once)")
    ap.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--output-len", type=int, default=200, help="mean output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    args = ap.parse_args(argv)
    if args.num < 1 or args.input_len < 1 or args.output_len < 1:
        ap.error("--num, --input-len and --output-len must be >= 1")
    write_trace(args.out, args.num, args.rate, args.input_len, args.output_len, args.seed)


if __name__ == "__main__":
    main()
