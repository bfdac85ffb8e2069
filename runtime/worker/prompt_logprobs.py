"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-softmax of the logits at every prompt
position, gathered at the next prompt token. A chunk of a row that asks adds its positions to the
step's logits_index after the sampled ones, so rows that do not ask cost nothing; the parts of a
prompt's chunks collect here until its last chunk samples, then go out with that row's result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, PromptLogprobs


@dataclass
class PromptPart:
    """One step's prompt logprobs on the device, for rows [(row, request id, positions, k)]."""

    rows: list[tuple[int, str, int, int]]
    chosen: torch.Tensor  # [P] logprob of the next prompt token
    ranks: torch.Tensor  # [P]
    top_vals: Optional[torch.Tensor]  # [P, kmax]
    top_ids: Optional[torch.Tensor]


class PromptLogprobRows:
    def __init__(self, max_rows: int):
        self.want = [-1] * max_rows  # SamplingParams.prompt_logprobs per row
        self.prompt: list[list[int]] = [[] for _ in range(max_rows)]
        self.request: list[str] = [""] * max_rows
        self.parts: list[list[PromptLogprobs]] = [[] for _ in range(max_rows)]
        self.asking: set[int] = set()  # rows whose prompt logprobs are not out yet: empty, a step pays nothing
        self.positions = 0  # prompt positions whose logprobs were computed, since start

    def start(self, new: NewSeq) -> None:
        self.want[new.row] = new.sampling.prompt_logprobs
        self.request[new.row] = new.request_id
        self.parts[new.row] = []
        self.prompt[new.row] = new.prompt_ids if new.sampling.prompt_logprobs >= 0 else []
        (self.asking.add if new.sampling.prompt_logprobs >= 0 else self.asking.discard)(new.row)

    def release(self, rows: list[int]) -> None:
        """These rows' requests ended (StepPlan.release_rows): one that ended before its first token
        would keep its prompt and parts here until its row was reused."""
        for row in rows:
            self.want[row], self.request[row], self.prompt[row], self.parts[row] = -1, "", [], []
            self.asking.discard(row)

    def asks(self, row: int) -> bool:
        return self.want[row] >= 0

    def targets(self, chunk: PrefillChunk) -> int:
        """How many of the chunk's positions predict a prompt token (all but the prompt's last)."""
        if not self.asks(chunk.row):
            return 0
        return max(0, min(chunk.start + len(chunk.token_ids), len(self.prompt[chunk.row]) - 1) - chunk.start)

    def compute(self, logits: torch.Tensor, plan_rows: list[tuple[int, int, int]]) -> PromptPart:
        """`logits` [P, V]: the step's prompt positions, for (row, first position, count) in order."""
        device = logits.device
        targets = torch.tensor([t for row, start, n in plan_rows for t in self.prompt[row][start + 1:start + 1 + n]],
                               dtype=torch.int64).to(device)
        self.positions += len(targets)
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, targets[:, None]).squeeze(1)
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
        k = max(self.want[row] for row, _, _ in plan_rows)
        vals, ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
        rows = [(row, self.request[row], n, self.want[row]) for row, _, n in plan_rows]
        return PromptPart(rows, chosen, ranks, vals, ids)

    def collect(self, part: Optional[PromptPart]) -> None:
        """A finished step's part, to the host; parts of rows that ended (or were reused) are dropped."""
        if part is None:
            return
        chosen, ranks = part.chosen.tolist(), part.ranks.tolist()
        vals = part.top_vals.tolist() if part.top_vals is not None else None
        ids = part.top_ids.tolist() if part.top_ids is not None else None
        at = 0
        for row, request_id, n, k in part.rows:
            if self.request[row] == request_id:
                piece = PromptLogprobs(logprobs=chosen[at:at + n], ranks=ranks[at:at + n])
                if k > 0:
                    piece.top_ids = [r[:k] for r in ids[at:at + n]]
                    piece.top_logprobs = [r[:k] for r in vals[at:at + n]]
                self.parts[row].append(piece)
            at += n

    def takers(self, sampled_rows: list[int]) -> Optional[list[tuple[int, int, str]]]:
        """At launch: the sampled rows that asked, (index, row, request id); None when none did."""
        if not self.asking:
            return None
        out = [(i, r, self.request[r]) for i, r in enumerate(sampled_rows) if r in self.asking]
        return out or None

    def take(self, takers: list[tuple[int, int, str]], num_rows: int) -> list[Optional[PromptLogprobs]]:
        """At finish: each taker's whole prompt logprobs (its first token was sampled), by result index."""
        out: list[Optional[PromptLogprobs]] = [None] * num_rows
        for i, row, request_id in takers:
            if self.request[row] != request_id or not self.asks(row):
                continue  # the row ended and was reused meanwhile
            parts, self.parts[row] = self.parts[row], []
            self.want[row] = -1
            self.asking.discard(row)
            whole = out[i] = PromptLogprobs(logprobs=[], ranks=[])
            for p in parts:
                whole.logprobs += p.logprobs
                whole.ranks += p.ranks
                whole.top_ids += p.top_ids
                whole.top_logprobs += p.top_logprobs
        return out
