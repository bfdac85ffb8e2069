"""Per-row sampling parameters and penalty counters, kept on the model's device so that a step
samples every row in one batched call with no host round trip per request."""
from __future__ import annotations

from typing import Optional

import torch

from llaunch import kernels
from llaunch.runtime.ipc.messages import SamplingParams
from llaunch.runtime.worker.transfer import to_device


class SamplingState:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
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

    def plain_greedy(self, rows: list[int]) -> bool:
        """Is every row's token the argmax of its raw logits (greedy, no penalties)?"""
        return all(self.greedy[r] and not self.penalized[r] for r in rows)

    def advance(self, rows: list[int]) -> None:
        """Count a token sampled elsewhere (the decode graph's argmax) for these rows."""
        for r in rows:
            self.generated[r] += 1

    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens [len(rows)] for logits [len(rows), V]; also advances the rows' counters."""
        penalized = any(self.penalized[r] for r in rows)
        rows_t = to_device(rows, torch.int64, self.device)
        if penalized:
            counts, seen = self._penalty_tables()
            logits = kernels.apply_penalties(logits, counts[rows_t].to(logits.dtype), self.presence[rows_t],
                                             self.frequency[rows_t], self.repetition[rows_t], seen[rows_t])
        if all(self.greedy[r] for r in rows):
            tokens = torch.argmax(logits, dim=-1)
        else:
            offsets = to_device([self.generated[r] for r in rows], torch.int64, self.device)
            tokens = kernels.sample(logits, self.temperature[rows_t], self.top_p[rows_t], self.top_k[rows_t],
                                    self.seed[rows_t], offsets, top_filters=any(self.filtered[r] for r in rows))
        if penalized:
            counts[rows_t, tokens] += 1
            seen[rows_t, tokens] = True
        self.advance(rows)
        return tokens

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
