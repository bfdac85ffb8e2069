"""Greedy text with speculation against without, on the same prompts: #38 asks that a bfloat16 server's verify
steps give the text its decode steps give. bench_spec.sh's c1 runs send each server the same prompts (a seed per
run) at temperature 0 and keep the generated text (bench_serving.py --keep-text); this compares each spec
server's texts with spec=none's, request by request, and says where the first one parts (a NAME_ri server,
kernels.row_invariant=true, against none_ri's: the decode path of a server like it). Two runs whose prompts hit the
prefix cache for other token counts prefilled them differently (a cached prefix, then a chunk after it): in
bfloat16 that alone can change any token after it, so such runs are said not comparable rather than counted (a
server that ran other cases before, e.g. CASES=c1 alone against a c1 + c64 one, holds other prefixes).

    python scripts/spec_text_agreement.py OUT [--case c1] [--variants spec k8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os


def _texts(path: str) -> tuple[int, list[str | None], float | None]:
    """(the run's seed, its texts (None: a failed request), the prompt tokens it found in the prefix cache)."""
    with open(path) as f:
        record = json.load(f)
    texts = [r.get("generated_text") if r.get("success") else None for r in record["requests"]]
    return record["args"]["seed"], texts, record.get("prefix_cache_hits")


def _parted_at(a: str, b: str) -> int:
    """The first character where two texts differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def base_of(variant: str) -> str:
    """The spec=none server a variant's texts are held against: none_ri for NAME_ri (kernels.row_invariant)."""
    return "none_ri" if variant.endswith("_ri") else "none"


def compare(out: str, case: str, variant: str, repeats: int) -> str:
    same = total = 0
    parted: list[int] = []
    none = base_of(variant)
    for r in range(1, repeats + 1):
        base, other = (os.path.join(out, f"bench-{v}-{case}-{r}.json") for v in (none, variant))
        if not (os.path.exists(base) and os.path.exists(other)):
            continue
        (seed_a, want, hits_a), (seed_b, got, hits_b) = _texts(base), _texts(other)
        if seed_a != seed_b or len(want) != len(got):
            return f"{case} {variant}: run {r} sent other prompts than {none}'s (seeds {seed_a}, {seed_b})"
        if hits_a != hits_b:
            return (f"{case} {variant}: run {r} not comparable with {none}'s: its prompts hit the prefix cache for "
                    f"{hits_b} tokens against {hits_a} (prefilled otherwise; run both servers through the same cases)")
        for a, b in zip(want, got):
            if a is None or b is None:
                continue  # a failed request: counted by the throughput table
            total += 1
            if a == b:
                same += 1
            else:
                parted.append(_parted_at(a, b))
    if not total:
        return f"{case} {variant}: no texts to compare (run bench_serving.py with --keep-text)"
    line = f"{case} {variant}: {same} of {total} greedy texts as {'spec=none' if none == 'none' else none}'s"
    if parted:
        line += f"; the others part after {min(parted)}-{max(parted)} characters"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--case", default="c1")
    ap.add_argument("--variants", nargs="+", default=["spec"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for v in args.variants:
        if v not in ("none", "none_ri"):
            print(compare(args.out, args.case, v, args.repeats))


if __name__ == "__main__":
    main()
