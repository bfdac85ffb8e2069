"""One request's token exclusions in the worker, as its row of a step's token bitmask (32 tokens a
32-bit word, a set bit allowed, xgrammar's layout): its grammar's next tokens, only `allowed_ids`,
never `banned_ids`, a first token among `heal_ids` (token healing), not the last token of a
`banned_sequences` entry whose other tokens end the output, no eos or stop token before `min_tokens`.

A grammar or a banned sequence depends on the tokens sampled so far (`needs_history`): the worker
fills such a row only once the step before it has been read back (`accept`)."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Optional

import numpy as np
import torch

from llaunch.runtime.constrained.compiler import ConstraintError
from llaunch.runtime.ipc.messages import SamplingParams

log = logging.getLogger(__name__)


def clear_bits(row: np.ndarray, ids) -> None:
    """Disallow `ids` in one bitmask row (a uint32 view)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size:
        np.bitwise_and.at(row, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def set_bits(row: np.ndarray, ids) -> None:
    """Allow `ids` in one bitmask row (a uint32 view)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size:
        np.bitwise_or.at(row, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))


def only_bits(row: np.ndarray, ids) -> None:
    """Keep only `ids` allowed in one bitmask row (a uint32 view)."""
    ids = np.asarray(ids, dtype=np.int64)
    keep = np.zeros_like(row)
    np.bitwise_or.at(keep, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
    row &= keep


class RowConstraint:
    def __init__(self, sp: SamplingParams, grammar: Optional[Future], stop_ids: list[int]):
        """`grammar`: a future of the compiled grammar (GrammarCompiler.compile_async) or None;
        `stop_ids`: the tokens min_tokens holds back (eos ids and the request's stop token ids)."""
        self.banned = sp.banned_ids
        self.sequences = [s for s in sp.banned_sequences if s]
        self.allowed = sp.allowed_ids
        self.heal = sp.heal_ids  # token healing: the first token's only choices
        self.min_tokens = sp.min_tokens
        self.stop_ids = stop_ids
        self._grammar = grammar
        self._matcher = None
        self._tail: list[int] = []  # the last output tokens, as many as a banned sequence needs
        self._tail_len = max((len(s) - 1 for s in self.sequences), default=0)
        self.generated = 0  # tokens accepted so far

    @property
    def needs_history(self) -> bool:
        return self._grammar is not None or bool(self.sequences)

    @property
    def spent(self) -> bool:
        """Nothing is left to exclude: only a first-token healing or min_tokens held, and both are past."""
        return (self._grammar is None and not (self.banned or self.sequences or self.allowed)
                and self.generated >= max(self.min_tokens, 1 if self.heal else 0))

    def _matcher_now(self):
        if self._matcher is None and self._grammar is not None:
            import xgrammar as xgr

            try:
                compiled = self._grammar.result()  # compiled off the step loop while the prompt prefilled
            except ConstraintError as e:
                # the frontend compiled the same spec to admit the request, so this is a bug: end the
                # output at once (only stop tokens allowed) rather than take the worker down
                log.error("a constraint the frontend admitted does not compile here: %s", e)
                self._grammar, self.allowed, self.min_tokens = None, list(self.stop_ids), 0
                return None
            # it ends on the model's stop tokens, not the tokenizer's
            self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids or None)
        return self._matcher

    def live_matcher(self):
        """The grammar's matcher while the grammar still decides the next token, else None."""
        matcher = self._matcher_now()
        return matcher if matcher is not None and not matcher.is_terminated() else None

    def has_extras(self, generated: int) -> bool:
        """Does anything besides the grammar exclude tokens at this point of the output?"""
        return bool(self.allowed or (self.heal and generated == 0) or self.banned or self.sequences
                    or generated < self.min_tokens)

    def fill(self, bitmask: torch.Tensor, i: int, generated: int) -> None:
        """Write row `i` of `bitmask` (CPU int32) for the next token; `generated` tokens came before it.
        (A step's rows are filled together by runtime/constrained/mask_fill.py.)"""
        matcher = self.live_matcher()
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, i)
        else:
            bitmask[i] = -1
        self.fill_extras(bitmask[i].numpy().view(np.uint32), generated)

    def fill_extras(self, row: np.ndarray, generated: int) -> None:
        """Apply the exclusions besides the grammar to one bitmask row (a uint32 view) that holds the
        grammar's mask, or all tokens where there is none."""
        if self.allowed:
            only_bits(row, self.allowed)
        if self.heal and generated == 0:
            only_bits(row, self.heal)
        if self.banned:
            clear_bits(row, self.banned)
        for seq in self.sequences:
            before = len(seq) - 1  # the tokens that must end the output for seq's last to be banned
            if before == 0 or (len(self._tail) >= before and self._tail[len(self._tail) - before:] == seq[:-1]):
                clear_bits(row, seq[-1:])
        if generated < self.min_tokens:
            clear_bits(row, self.stop_ids)
        self.end_if_empty(row)

    def end_if_empty(self, row: np.ndarray) -> None:
        """A row that allows nothing (allowed ids all banned, a grammar at a dead end) ends the output:
        sampling from all -inf logits would draw garbage."""
        if not row.any():
            set_bits(row, self.stop_ids or range(len(row) * 32))

    def accept(self, token: int) -> bool:
        """The token sampled for this row; False if the grammar refuses it (it cannot, when the
        mask was applied, unless the grammar had already ended)."""
        self.generated += 1
        if self._tail_len:
            self._tail = (self._tail + [token])[-self._tail_len:]
        matcher = self._matcher_now()
        if matcher is None or matcher.is_terminated():
            return True
        return matcher.accept_token(token)
