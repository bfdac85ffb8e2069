"""Speculative decoding in the benchmark: the copy-heavy workload (--copy-prompts) and the server's
`<prefix>:spec_decode_*` counters over the measured run (proposals, their tokens, those accepted)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from bench_workload import series_totals

SPEC_SERIES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def copy_prompts(num: int, input_len: int, vocab_size: int, seed: int, low: int = 100) -> list[list[int]]:
    """`num` prompts of `input_len` token ids: a random text, then its beginning again, so a model
    continues by copying it (induction) and n-gram proposals from the prompt are right."""
    rng = np.random.default_rng(seed)
    half = max(input_len // 2, 1)
    texts = rng.integers(low, vocab_size, size=(num, half)).tolist()
    return [(t + t)[:input_len] for t in texts]


def spec_counts(metrics_text: str) -> Optional[tuple[float, float, float]]:
    """(proposals, proposed tokens, accepted tokens) summed over series; None when not exposed."""
    return series_totals(metrics_text, SPEC_SERIES)


def spec_result(before, after) -> dict[str, float]:
    """The measured run's figures: proposals, tokens proposed / accepted, the acceptance rate and the
    mean tokens a verify step yields per row (accepted + the one it samples itself)."""
    if before is None or after is None:
        return {}
    drafts, proposed, accepted = (a - b for a, b in zip(after, before))
    if drafts <= 0:
        return {"spec_drafts": 0.0}
    return {"spec_drafts": drafts, "spec_draft_tokens": proposed, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_tokens_per_verify": 1.0 + accepted / drafts}


def spec_rows(result: dict) -> list[tuple[str, object, str]]:
    if "spec_draft_tokens" not in result:
        return [("Spec decode proposals", 0, "d")] if "spec_drafts" in result else []
    return [("Spec decode proposals / tokens", f"{result['spec_drafts']:.0f} / {result['spec_draft_tokens']:.0f}", "s"),
            ("Spec decode acceptance (%)", 100 * result["spec_acceptance_rate"], ".2f"),
            ("Spec decode tokens per verify step", result["spec_tokens_per_verify"], ".2f")]
