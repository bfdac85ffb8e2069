"""The router's check of every request before the scheduler sees it: the frontend validates too, but
the worker must never get a value its tensors cannot hold (a float32 overflow, an int64 that does
not fit, a token outside the vocabulary), whoever sent the message."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from llaunch.runtime.constrained.compiler import KINDS, MAX_SPEC_CHARS
from llaunch.runtime.ipc.messages import AddRequest

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_TOP_LOGPROBS = 20
MAX_EXCLUSION_IDS = 1 << 17  # banned, allowed, biased and banned-sequence tokens of one request


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    max_model_len: int
    max_stop_strings: int
    max_stop_string_chars: int


def _within(value: float, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high


def _images_only_past_vocab(prompt: list[int], images, vocab_size: int) -> bool:
    """Is every id past the vocabulary part of an image's run of tokens (one id repeated from the
    image's offset on)? Nothing else has an embedding row to read."""
    starts = {im.offset for im in images}
    for i, t in enumerate(prompt):
        if t >= vocab_size and i not in starts and (i == 0 or prompt[i - 1] != t):
            return False
    return True


def refusal(msg: AddRequest, limits: AdmissionLimits) -> Optional[str]:
    """Why the request cannot run, or None."""
    s, prompt = msg.sampling, msg.prompt_ids
    if not prompt:
        return "the prompt is empty"
    # an image's tokens are vocab_size + its hash (runtime/http/images.py)
    if any(t < 0 for t in prompt) or not _images_only_past_vocab(prompt, msg.images, limits.vocab_size):
        return f"a prompt token id is outside the vocabulary [0, {limits.vocab_size})"
    if not 1 <= s.max_new_tokens <= INT32_MAX or len(prompt) + s.max_new_tokens > limits.max_model_len:
        return (f"{len(prompt)} prompt tokens + max_new_tokens {s.max_new_tokens} do not fit the context of "
                f"{limits.max_model_len}")
    checks = (("temperature", s.temperature, 0.0, 1e4), ("top_p", s.top_p, 1e-30, 1.0),
              ("presence_penalty", s.presence_penalty, -100.0, 100.0),
              ("frequency_penalty", s.frequency_penalty, -100.0, 100.0),
              ("repetition_penalty", s.repetition_penalty, 1e-30, 100.0))
    for name, value, low, high in checks:
        if not _within(value, low, high):
            return f"{name}={value!r} is outside [{low}, {high}]"
    if not -1 <= s.top_k <= INT32_MAX:
        return f"top_k={s.top_k} is outside [-1, {INT32_MAX}]"
    if s.seed is not None and not -INT64_MAX <= s.seed <= INT64_MAX:
        return "the seed does not fit 64 bits"
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs={s.top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]"
    if not -1 <= s.prompt_logprobs <= MAX_TOP_LOGPROBS:
        return f"prompt_logprobs={s.prompt_logprobs} is outside [-1, {MAX_TOP_LOGPROBS}]"
    if len(s.stop_token_ids) > limits.max_stop_strings or any(not 0 <= t < limits.vocab_size for t in s.stop_token_ids):
        return f"more than {limits.max_stop_strings} stop token ids, or one outside the vocabulary"
    if len(s.stop) > limits.max_stop_strings or any(len(x) > limits.max_stop_string_chars for x in s.stop):
        return (f"more than {limits.max_stop_strings} stop strings, or one longer than "
                f"{limits.max_stop_string_chars} characters")
    return _exclusions_refusal(s, limits)


def _exclusions_refusal(s, limits: AdmissionLimits) -> Optional[str]:
    """The token exclusions: ids inside the vocabulary, bounded counts, finite biases."""
    if not _within(s.min_p, 0.0, 1.0):
        return f"min_p={s.min_p!r} is outside [0, 1]"
    if not 0 <= s.min_tokens <= s.max_new_tokens:
        return f"min_tokens={s.min_tokens} is outside [0, max_new_tokens]"
    if len(s.bias_ids) != len(s.bias_values) or any(not _within(v, -100.0, 100.0) for v in s.bias_values):
        return "logit_bias needs one value in [-100, 100] per token"
    groups = (s.bias_ids, s.banned_ids, s.allowed_ids, s.heal_ids, *s.banned_sequences)
    if sum(len(g) for g in groups) > MAX_EXCLUSION_IDS:
        return f"more than {MAX_EXCLUSION_IDS} biased, banned, allowed or healing token ids"
    if any(not 0 <= t < limits.vocab_size for g in groups for t in g):
        return f"a biased, banned or allowed token id is outside the vocabulary [0, {limits.vocab_size})"
    if s.constraint is not None and (s.constraint.kind not in KINDS or len(s.constraint.spec) > MAX_SPEC_CHARS):
        return f"a constraint is one of {', '.join(KINDS)} of at most {MAX_SPEC_CHARS} characters"
    return None
