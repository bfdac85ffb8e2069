"""Per-row sampling parameters and penalty counters, kept on the model's device so that a step
samples every row in one batched call with no host round trip per request; and each row's token
exclusions (structured output, banned tokens, min_tokens: runtime/constrained/row_state.py) as the
step's token bitmask, with logit_bias and min_p applied before the draw."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from llaunch.kernels import dispatch as ops
from llaunch.runtime.constrained.mask_fill import StepMasks
from llaunch.runtime.constrained.row_state import RowConstraint
from llaunch.runtime.ipc.messages import SamplingParams
from llaunch.runtime.worker.transfer import to_device


class SamplingState:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, eos_ids: tuple[int, ...] = (),
                 grammar: Optional[Callable] = None, mask_threads: Optional[int] = None):
        """`grammar`: returns the worker's GrammarCompiler (made on first use: it loads the tokenizer);
        None refuses structured output. `mask_threads`: the threads that fill grammar masks."""
        self.vocab_size = vocab_size
        self.device = device
        self.eos_ids = list(eos_ids)
        self._grammar = grammar
        self.rows: list[Optional[RowConstraint]] = [None] * max_rows  # token exclusions, where any
        self._masks = StepMasks(max_rows, vocab_size, device, mask_threads)
        self.bias: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * max_rows  # logit_bias ids, values
        self.min_p = [0.0] * max_rows
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.zeros(max_rows, **f32)
        self.top_p = torch.ones(max_rows, **f32)
        self.top_k = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.presence = torch.zeros(max_rows, **f32)
        self.frequency = torch.zeros(max_rows, **f32)
        self.repetition = torch.ones(max_rows, **f32)
        # host mirrors that decide which code path a step takes (no device reads)
        self.greedy = [True] * max_rows
        self.filtered = [False] * max_rows  # uses top-k or top-p
        self.penalized = [False] * max_rows
        self.top_logprobs = [-1] * max_rows  # -1: no logprobs; 0: chosen token only; n: plus top n
        self.generated = [0] * max_rows  # tokens sampled so far: the noise counter
        self._counts: Optional[torch.Tensor] = None  # [rows, vocab] int32, made on first penalized request
        self._seen: Optional[torch.Tensor] = None  # [rows, vocab] bool: prompt or output token

    def _penalty_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None:
            rows = self.temperature.shape[0]
            self._counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self._seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        return self._counts, self._seen

    def set_rows(self, news: list[tuple[int, SamplingParams, list[int]]]) -> None:
        """Set up new requests' rows: (row, sampling, prompt ids) each. One batched write per field:
        assigning a Python number to a CUDA tensor element is a synchronous copy that waits for the
        steps in flight (a mixed step's launch then took the whole previous step)."""
        if not news:
            return
        rows = to_device([r for r, _, _ in news], torch.int64, self.device)
        for table, values, dtype in (
                (self.temperature, [sp.temperature for _, sp, _ in news], torch.float32),
                (self.top_p, [sp.top_p for _, sp, _ in news], torch.float32),
                (self.top_k, [sp.top_k for _, sp, _ in news], torch.int64),
                (self.seed, [(sp.seed or 0) & (2**63 - 1) for _, sp, _ in news], torch.int64),  # the noise hashes only the low bits
                (self.presence, [sp.presence_penalty for _, sp, _ in news], torch.float32),
                (self.frequency, [sp.frequency_penalty for _, sp, _ in news], torch.float32),
                (self.repetition, [sp.repetition_penalty for _, sp, _ in news], torch.float32)):
            table[rows] = to_device(values, dtype, self.device)
        for row, sp, prompt_ids in news:
            self._set_exclusions(row, sp)
            self.greedy[row] = sp.greedy
            self.filtered[row] = sp.top_p < 1.0 or 0 < sp.top_k < self.vocab_size
            self.penalized[row] = sp.penalized
            self.top_logprobs[row] = sp.top_logprobs if sp.logprobs else -1
            self.generated[row] = 0
            if sp.penalized:
                counts, seen = self._penalty_tables()
                counts[row].zero_()
                seen[row].zero_()
                if prompt_ids:
                    seen[row].index_fill_(0, to_device(prompt_ids, torch.int64, self.device), True)

    def _set_exclusions(self, row: int, sp: SamplingParams) -> None:
        self.min_p[row] = sp.min_p if not sp.greedy else 0.0  # min_p keeps the most likely token: moot when greedy
        self.bias[row] = ((to_device(sp.bias_ids, torch.int64, self.device),
                           to_device(sp.bias_values, torch.float32, self.device)) if sp.bias_ids else None)
        excludes = (sp.constraint or sp.banned_ids or sp.banned_sequences or sp.allowed_ids or sp.heal_ids
                    or sp.min_tokens)
        if not excludes:
            self.rows[row] = None
            return
        grammar = None
        if sp.constraint is not None:
            if self._grammar is None:
                raise ValueError("structured output needs the worker's tokenizer")
            grammar = self._grammar().compile_async(sp.constraint)  # compiles while the prompt prefills
        self.rows[row] = RowConstraint(sp, grammar, self.eos_ids + list(sp.stop_token_ids))

    def plain_greedy(self, rows: list[int]) -> bool:
        """Is every row's token the argmax of its raw logits (greedy, no penalties or exclusions)?"""
        return all(self.greedy[r] and not self.penalized[r] and self.rows[r] is None and self.bias[r] is None
                   for r in rows)

    def needs_history(self, rows: list[int]) -> bool:
        """Does a row's mask depend on tokens sampled so far (a grammar, a banned sequence)?"""
        return any(self.rows[r] is not None and self.rows[r].needs_history for r in rows)

    def bitmask(self, rows: list[int]) -> Optional[torch.Tensor]:
        """The step's token bitmask on the device ([len(rows), words]; all allowed where a row
        excludes nothing), or None when no row excludes anything. A needs_history row must have
        accepted every token sampled for it before this is called."""
        if all(self.rows[r] is None for r in rows):
            return None
        return self._masks.fill([(i, self.rows[r], self.generated[r]) for i, r in enumerate(rows)
                                  if self.rows[r] is not None], len(rows))

    def accept(self, rows: list[int], tokens: list[int]) -> None:
        """The tokens a step sampled, read back: rows with exclusions follow their output."""
        for r, token in zip(rows, tokens):
            if self.rows[r] is not None:
                self.rows[r].accept(token)
                if self.rows[r].spent:  # the row samples as a plain one again (the decode graph's argmax)
                    self.rows[r] = None

    def _exclude(self, logits: torch.Tensor, rows: list[int], bitmask: Optional[torch.Tensor]) -> torch.Tensor:
        """logit_bias, the bitmask and min_p, on a copy (logprobs report the model's own distribution)."""
        biased = [i for i, r in enumerate(rows) if self.bias[r] is not None]
        with_min_p = [i for i, r in enumerate(rows) if self.min_p[r] > 0.0]
        if not biased and bitmask is None and not with_min_p:
            return logits
        logits = logits.clone()
        for i in biased:
            ids, values = self.bias[rows[i]]
            logits[i].index_add_(0, ids, values.to(logits.dtype))
        if bitmask is not None:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask)
        if with_min_p:  # p_i < min_p · p_max  ⟺  l_i < l_max + T · ln(min_p)
            index = to_device(with_min_p, torch.int64, self.device)
            rows_t = to_device([rows[i] for i in with_min_p], torch.int64, self.device)
            floor = to_device([math.log(self.min_p[rows[i]]) for i in with_min_p], torch.float32, self.device)
            part = logits[index]
            cut = part.max(dim=-1, keepdim=True).values + (self.temperature[rows_t] * floor)[:, None]
            logits[index] = part.masked_fill(part < cut, float("-inf"))
        return logits

    def advance(self, rows: list[int]) -> None:
        """Count a token sampled elsewhere (the decode graph's argmax) for these rows."""
        for r in rows:
            self.generated[r] += 1

    def sample(self, logits: torch.Tensor, rows: list[int], bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens [len(rows)] for logits [len(rows), V]; also advances the rows' counters. `bitmask`:
        self.bitmask(rows), when any row excludes tokens."""
        penalized = any(self.penalized[r] for r in rows)
        rows_t = to_device(rows, torch.int64, self.device)
        if penalized:
            counts, seen = self._penalty_tables()
            logits = ops.apply_penalties(logits, counts[rows_t].to(logits.dtype), self.presence[rows_t],
                                             self.frequency[rows_t], self.repetition[rows_t], seen[rows_t])
        logits = self._exclude(logits, rows, bitmask)
        drawn = [i for i, r in enumerate(rows) if not self.greedy[r]]
        if drawn and len(drawn) == len(rows):
            tokens = self._draw(logits, rows, rows_t)
        else:  # greedy rows take the argmax; only the others draw noise over the vocabulary
            tokens = torch.argmax(logits, dim=-1)
            if drawn:
                index = to_device(drawn, torch.int64, self.device)
                tokens[index] = self._draw(logits[index], [rows[i] for i in drawn], rows_t[index])
        if penalized:
            counts[rows_t, tokens] += 1
            seen[rows_t, tokens] = True
        self.advance(rows)
        return tokens

    def _draw(self, logits: torch.Tensor, rows: list[int], rows_t: torch.Tensor) -> torch.Tensor:
        """Sampled rows' tokens: each row's noise is a hash of its own seed and counter, so a row draws
        the same token whichever rows share its call."""
        offsets = to_device([self.generated[r] for r in rows], torch.int64, self.device)
        return ops.sample(logits, self.temperature[rows_t], self.top_p[rows_t], self.top_k[rows_t],
                              self.seed[rows_t], offsets, top_filters=any(self.filtered[r] for r in rows))

    def logprobs(self, logits: torch.Tensor, rows: list[int], tokens: torch.Tensor):
        """Device tensors (chosen [S], top values [S, k], top ids [S, k], per-row k) or None when no
        row asked. Logprobs are of the model's distribution (raw logits), as vLLM and OpenAI report
        them. Computed when the step is launched: the logits buffer is reused by the next step."""
        wants = [self.top_logprobs[r] for r in rows]
        if max(wants, default=-1) < 0:
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, tokens[:, None]).squeeze(1)
        k = max(wants)
        vals, ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
        return chosen, vals, ids, wants


def logprobs_to_host(device_lp) -> tuple[list[float], list[list[int]], list[list[float]]]:
    chosen, vals, ids, wants = device_lp
    top_ids: list[list[int]] = [[] for _ in wants]
    top_lps: list[list[float]] = [[] for _ in wants]
    if vals is not None:
        vals, ids = vals.tolist(), ids.tolist()
        for i, n in enumerate(wants):
            if n > 0:
                top_ids[i], top_lps[i] = ids[i][:n], vals[i][:n]
    return chosen.tolist(), top_ids, top_lps
