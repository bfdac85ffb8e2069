"""Per-token cost of incremental detokenization (runtime/detokenizer/incremental.py) on the default
model's tokenizer: a natural text and random token ids, each streamed one token at a time; the minimum
of three runs. Usage: .venv/bin/python scripts/bench_detokenize.py"""
from __future__ import annotations

import random
import time
from pathlib import Path

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.detokenizer.incremental import IncrementalDecoder
from llaunch.runtime.models.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def per_token_us(tokenizer, ids: list[int]) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        decoder = IncrementalDecoder(tokenizer)
        for token_id in ids:
            decoder.push(token_id)
        decoder.flush()
        best = min(best, (time.perf_counter() - t) / len(ids) * 1e6)
    return best


def main() -> None:
    tokenizer = load_tokenizer(ModelConfig(path=str(REPO / ".models" / "smollm2-135m")))
    text = "Grüße aus 東京 🗼! The quick brown fox jumps over the lazy dog. " * 40
    rng = random.Random(0)
    cases = {"text": tokenizer.encode(text, add_special_tokens=False),
             "random ids": [rng.randrange(len(tokenizer)) for _ in range(4000)]}
    for name, ids in cases.items():
        print(f"{name}: {len(ids)} tokens, {per_token_us(tokenizer, ids):.2f} µs per token (min of 3)")


if __name__ == "__main__":
    main()
