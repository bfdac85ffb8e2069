"""Verify steps of speculative decoding as decode steps, replayed from CUDA graphs.

A step with verify chunks and plain decode rows, but no prefill chunk, is laid out as T decode tokens:
one per plain row, then each verify chunk's n tokens (the row's last token and its proposal) as n
decode tokens of the same row whose lengths are start+1 .. start+n. Every token's K/V is stored
before attention, so token j of a chunk attends to the row's first start+j+1 tokens: causal
attention within the chunk, through the decode attention kernel (several query tokens per sequence
are several entries of the same row). The logits of all T tokens come back, and with them the greedy
verdict of every chunk, judged in the step itself (spec_verify.greedy_verdict: on a GPU inside the graph, not
~20 eager launches after it); a step with sampled rows judges from the logits (runtime/worker/spec_verify.py).

Decode attention's grid depends only on T, so the step has fixed shapes: one CUDA graph per bucket
of T (every size to 8, then every 8 ...) up to the most tokens a speculating step can have (spec.max_batch
rows × spec.num_tokens + 1). Launched eagerly, a verify step of SmolLM2-135M costs the host ~300
kernel launches against a few hundred microseconds on the device; a replay is one copy and one
launch. Padding tokens are scratch rows (as the decode graphs'). On a CPU the same padded step runs
eagerly, which is how the CPU tests check the layout and the padding.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from llaunch.kernels import pdl
from llaunch.runtime.ipc.messages import StepPlan
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.models.memory import MAX_VERIFY_GRAPH_TOKENS
from llaunch.runtime.worker.cuda_graphs import bucket_sizes, capture_buckets
from llaunch.runtime.worker.spec_verify import greedy_verdict

log = logging.getLogger("llaunch.worker")

# per token: id (-1: the row's last sampled token, on the device; -2 - i: element i of the draft's proposals left on
# the device, `proposed`), row, position, slot, length, and the index in the step of its chunk's first token (a
# decode row's: its own)
FIELDS = 6
LAST_TOKEN = -1
EXACT = 8  # steps of up to this many tokens replay a graph of their own size (batch 1, k <= 7: no padding)


def proposed_id(index: int) -> int:
    """The id that stands for element `index` of the proposals a draft left on the device."""
    return -2 - index


def verify_tokens(plan: StepPlan, seq_len: list[int], proposed: int = 0) -> list[list[int]]:
    """The step's tokens as decode tokens, [ids, rows, positions, slots, lengths, chunk starts]: plain decode rows
    first (their lengths in `seq_len` grow by one), then every verify chunk's tokens in plan order
    (their rows' lengths follow the verdict, not this). `proposed` > 0: the chunks' proposals are on the device,
    [chunks, proposed] in plan order (DraftSteps.proposals), and chunk i's token j ≥ 1 reads element
    i·proposed + j − 1 of them."""
    ids, rows, positions, slots, lens, starts = [], [], [], [], [], []
    for r, slot in zip(plan.decode_rows, plan.decode_slots):
        starts.append(len(ids))
        ids.append(LAST_TOKEN)
        rows.append(r)
        positions.append(seq_len[r])
        slots.append(slot)
        seq_len[r] += 1
        lens.append(seq_len[r])
    for i, chunk in enumerate(plan.verify):
        n = len(chunk.token_ids)
        starts.extend([len(ids)] * n)
        if proposed:
            ids.append(chunk.token_ids[0])
            ids.extend(proposed_id(i * proposed + j) for j in range(n - 1))
        else:
            ids.extend(chunk.token_ids)
        rows.extend([chunk.row] * n)
        positions.extend(range(chunk.start, chunk.start + n))
        slots.extend(chunk.slots)
        lens.extend(range(chunk.start + 1, chunk.start + n + 1))
    return [ids, rows, positions, slots, lens, starts]


class VerifySteps:
    def __init__(self, model, kv: KvCache, last_token: torch.Tensor, max_tokens: int, max_len: int,
                 scratch_row: int, scratch_slot: int, embed_rows: Optional[int] = None, verdicts: bool = False,
                 proposed: Optional[torch.Tensor] = None):
        """`max_tokens`: the largest step padded to a bucket (0: none, every step runs unpadded);
        `max_len`: the longest context a padded step covers (its attention's split count). `embed_rows`: a
        draft model's embedding rows, when it runs the target's steps (an id past them reads token 0).
        `verdicts`: the step also judges its chunks greedily and sets their rows' last tokens (the model's
        steps; not a draft's, which runs them only for its KV). `proposed`: the flat buffer a draft leaves its
        proposals in (DraftSteps.proposals), which ids below -1 read (verify_tokens' `proposed`)."""
        self.model, self.kv, self.last_token, self.proposed = model, kv, last_token, proposed
        self.verdicts = verdicts
        self.embed_rows = embed_rows
        self.scratch_row, self.scratch_slot, self.max_len = scratch_row, scratch_slot, max_len
        top = min(max_tokens, MAX_VERIFY_GRAPH_TOKENS)
        # every size up to EXACT: a batch-1 verify step of k+1 tokens runs unpadded
        self.buckets = sorted(set(bucket_sizes(top)) | set(range(1, min(top, EXACT) + 1))) if top > 0 else []
        device = last_token.device
        top = self.buckets[-1] if self.buckets else 0
        self.inputs = torch.zeros(FIELDS * top, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        # a ring of pinned host buffers: step N's copy may still be queued while N+1 is written
        self._host = [torch.zeros(FIELDS * top, dtype=torch.int64, pin_memory=cuda) for _ in range(3 if cuda else 1)]
        self._turn = 0
        self.logits_index = torch.arange(max(top, 1), dtype=torch.int64, device=device)
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # verify steps replayed from a graph (tests read it)

    def _forward(self, fields: torch.Tensor, max_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Device work only (capturable): fields [FIELDS, T] → (logits [T, vocab], with `verdicts` the greedy
        verdict [T], else None)."""
        ids, rows, positions, slots, lens, starts = fields
        self.kv.req_to_slots[rows, positions] = slots.to(self.kv.req_to_slots.dtype)
        input_ids = torch.where(ids >= 0, ids, self.last_token[rows])
        if self.proposed is not None:  # the draft's tokens, never read back to the host before the verdict
            input_ids = torch.where(ids < LAST_TOKEN, self.proposed[(proposed_id(0) - ids).clamp(min=0)], input_ids)
        tokens = input_ids  # what the verdict compares the model's tokens with
        if self.embed_rows is not None:
            input_ids = torch.where(input_ids < self.embed_rows, input_ids, torch.zeros_like(input_ids))
        t = ids.shape[0]
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, out_slots=slots, decode_rows=rows, decode_seq_lens=lens,
            prefill_rows=self._empty, prefill_q_starts=self._empty, prefill_q_lens=self._empty,
            prefill_prefix_lens=self._empty, logits_index=self.logits_index[:t] if t <= self.logits_index.shape[0]
            else torch.arange(t, device=ids.device), num_decode=t, num_prefill_tokens=0, max_decode_len=max_len,
            every_token=True)
        logits = self.model.forward(batch, self.kv)
        if not self.verdicts:
            return logits, None
        return logits, greedy_verdict(logits, tokens, ids != LAST_TOKEN, starts, rows, self.last_token, self.scratch_row)

    def _step(self, b: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self._forward(self.inputs[: FIELDS * b].view(FIELDS, b), self.max_len)

    def _fill(self, tokens: list[list[int]], b: int) -> None:
        """Write the step's tokens padded to bucket b (padding: scratch row, position 0, scratch slot)."""
        n = len(tokens[0])
        self._turn = (self._turn + 1) % len(self._host)
        flat = self._host[self._turn][: FIELDS * b]
        host = flat.view(FIELDS, b)
        if n:
            host[:, :n] = torch.tensor(tokens, dtype=torch.int64)
        host[0, n:], host[1, n:], host[2, n:], host[3, n:], host[4, n:] = 0, self.scratch_row, 0, self.scratch_slot, 1
        host[5, n:] = torch.arange(n, b)  # each padding token a chunk of its own
        self.inputs[: FIELDS * b].copy_(flat, non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.buckets:
            return
        with pdl.for_graphs():  # the warm-up compiles the PDL variants the capture records
            self.graphs = capture_buckets(self.buckets, lambda b: self._fill([[]] * FIELDS, b), self._step)
        log.info("captured verify CUDA graphs for steps of up to %d tokens (%d buckets)", self.buckets[-1],
                 len(self.buckets))

    def bucket(self, tokens: int, longest: int) -> Optional[int]:
        """The padded size a step of `tokens` tokens with contexts up to `longest` runs at, or None
        (unpadded, eager)."""
        if not self.buckets or tokens > self.buckets[-1] or longest > self.max_len:
            return None
        return next(b for b in self.buckets if b >= tokens)

    @torch.inference_mode()
    def run(self, tokens: list[list[int]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits [T, vocab], with `verdicts` the greedy verdict [T] or None) of the step's tokens (verify_tokens'
        layout), their K/V written. A graph's buffers are overwritten by its next replay: read them before."""
        n = len(tokens[0])
        b = self.bucket(n, max(tokens[4], default=0))
        if b is None:
            fields = torch.tensor(tokens, dtype=torch.int64).to(self.last_token.device, non_blocking=True)
            return self._forward(fields, max(tokens[4]))
        self._fill(tokens, b)
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            self.replays += 1
        else:
            out = self._step(b)
        logits, verdict = out
        return logits[:n], None if verdict is None else verdict[:n]
