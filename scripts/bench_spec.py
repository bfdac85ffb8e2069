"""Speculative decoding in the benchmark: the copy-heavy workloads (--copy-prompts) and the server's
`<prefix>:spec_decode_*` counters over the measured run (proposals, their tokens, those accepted).

`text` (the default) is what speculation is for: a passage of this repository's docs or code given twice, which a
model continues with a third copy, as it re-emits most of a text it edits or code it refactors. SmolLM2-135M
predicts 93% of such a copy's tokens (scripts/spec_acceptance.py: teacher-forced, float32). `random` gives random
token ids twice, which a model copies badly (SmolLM2-135M about half of them), so many proposals fail."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bench_workload import series_totals

SPEC_SERIES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def copy_prompts(num: int, input_len: int, vocab_size: int, seed: int, low: int = 100) -> list[list[int]]:
    """`num` prompts of `input_len` token ids: random ids, then their beginning again, so a model continues by
    copying them (induction) where it can, and n-gram proposals from the prompt are right where it does."""
    rng = np.random.default_rng(seed)
    half = max(input_len // 2, 1)
    texts = rng.integers(low, vocab_size, size=(num, half)).tolist()
    return [(t + t)[:input_len] for t in texts]


REPO = Path(__file__).resolve().parent.parent
CORPUS = ("docs/*.md", "runtime/**/*.py", "launcher/*.py", "kernels/*.py")  # the passages' files, on every checkout


def corpus_passages(tokenize: Callable[[str], list[int]], length: int, root: Path = REPO) -> list[list[int]]:
    """The corpus files (sorted) cut into consecutive passages of `length` tokens; a file's tail shorter than
    that is dropped."""
    passages = []
    for path in sorted({p for pattern in CORPUS for p in root.glob(pattern)}):
        ids = tokenize(path.read_text(encoding="utf-8"))
        passages += [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    return passages


def text_copy_prompts(num: int, input_len: int, tokenize: Callable[[str], list[int]], seed: int,
                      root: Path = REPO) -> list[list[int]]:
    """`num` prompts of `input_len` tokens: a random label, then a passage of the corpus, a blank line, and the
    passage again. Labels and the passages' order are the seed's own."""
    sep = tokenize("\n\n")
    rng = np.random.default_rng(seed)
    # a random label first: prompts share no prefix (but by chance a first token), so none hits the prefix cache
    heads = [tokenize(f"{label:08x}\n") for label in rng.integers(0, 2 ** 32, size=num)]
    # passages long enough for the shortest header: a longer header's prompt loses the last tokens of its second copy
    length = max((input_len - min(map(len, heads)) - len(sep) + 1) // 2, 1)
    passages = corpus_passages(tokenize, length, root)
    if not passages:
        raise ValueError(f"no passage of {length} tokens in {root} ({', '.join(CORPUS)})")
    order = rng.permutation(len(passages))
    return [(head + passages[order[i % len(order)]] + sep + passages[order[i % len(order)]])[:input_len]
            for i, head in enumerate(heads)]


def tokenizer_of(path: str) -> Callable[[str], list[int]]:
    """Text → token ids with a model's tokenizer.json (a model folder or the file itself), no special tokens."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    tok = Tokenizer.from_file(str(file))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


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
