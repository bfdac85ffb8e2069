"""The draft model's proposals (spec.method=draft) as one CUDA graph per batch bucket: all k greedy decode
steps of the draft, each step's argmax feeding the next, replayed with one launch.

Eagerly, each of the k steps launches the draft's whole forward (a 135M model: ~300 kernels) plus a dozen
small host→device copies, so a speculating step spent more host time proposing than the GPU spent on the
verify step. Everything but the tokens is known on the host before the first step: row i's step j writes
the token at position start+j into the chunk's slot j and attends over start+j+1 tokens. Those fields are
one pinned copy ([k + 1, 4, bucket]: the chunk's last position is recorded in `req_to_slots` too, as the
eager path does), the chunks' first tokens another; inside the graph each step's argmax is the next step's
input. A row that wants fewer than k tokens (its room: max_tokens, the context) and the bucket's padding
rows compute on the scratch row and slot for their remaining steps. On a CPU the same padded steps run
eagerly, which is how the CPU tests check the layout and the padding.

Drafted ahead (spec.draft_ahead, `run_ahead`), the same graph runs right behind a greedy verify step, before the
router has planned the next one: each row's start is its chunk's plus the tokens the verdict kept (counted on the
device), its first token the verdict's last, its K/V written into slots the router never gives out. A row alone
then has its proposals drafted while its verdict travels to the router and its next plan back.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import pdl
from llaunch.runtime.ipc.messages import VerifyChunk
from llaunch.runtime.models.batch import ForwardBatch
from llaunch.runtime.worker.cuda_graphs import bucket_sizes, capture_buckets

log = logging.getLogger("llaunch.worker")


class DraftSteps:
    def __init__(self, drafter, num_tokens: int, max_batch: int, max_len: int, scratch_row: int,
                 scratch_slot: int, ahead_slot: int = -1):
        """`drafter`: the Drafter whose model and KV the steps run; `num_tokens`: k, the most a chunk proposes;
        `max_batch`: the most verify chunks of a step (spec.max_batch); `max_len`: the longest context the
        steps' attention covers; `ahead_slot` (≥ 0): the first of the (k + 1)·max_batch slots, before the scratch
        slot and outside the router's in both caches, that proposals drafted ahead write (`run_ahead`)."""
        self.drafter, self.k, self.max_len = drafter, num_tokens, max_len
        self.scratch_row, self.scratch_slot = scratch_row, scratch_slot
        self.buckets = bucket_sizes(max_batch)
        top = self.buckets[-1]
        device = drafter.device
        cuda = device.type == "cuda"
        # per bucket b, the first (k + 1)·4·b + b elements: fields [k + 1, 4, b] (rows, positions, slots, lengths
        # of each step) then each chunk's last token [b]; one contiguous pinned copy a proposal
        self.inputs = torch.zeros(self._size(top), dtype=torch.int64, device=device)
        self.proposals = torch.zeros((top, self.k), dtype=torch.int64, device=device)
        # step j's argmax lands in proposals[:, j] through the greedy kernel's row index into the flat buffer
        self.proposal_index = (torch.arange(top, device=device)[None, :] * self.k
                               + torch.arange(self.k, device=device)[:, None]).contiguous()  # [k, top]
        # a ring of pinned host buffers: one proposal's copy may still be queued while the next is written (three:
        # the worker finishes step N before it launches N + 2, and proposals left on the device are never waited for)
        self._host = [torch.zeros(self._size(top), dtype=torch.int64, pin_memory=cuda) for _ in range(3 if cuda else 1)]
        self._turn = 0
        self.logits_index = torch.arange(top, dtype=torch.int64, device=device)
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.ahead_slots = None  # [k + 1, top]: chunk i's step j's slot when drafting ahead
        if ahead_slot >= 0:
            self.ahead_slots = (ahead_slot + torch.arange(top, device=device)[None, :] * (self.k + 1)
                                + torch.arange(self.k + 1, device=device)[:, None])
            self._step_offsets = torch.arange(self.k + 1, device=device)[:, None]
            # rows [b], starts [b], each chunk's verdict positions [b, k + 1] (-1 past its length): one pinned copy
            self._ahead_in = torch.zeros(top * (self.k + 3), dtype=torch.int64, device=device)
            self._ahead_host = [torch.zeros(top * (self.k + 3), dtype=torch.int64, pin_memory=cuda)
                                for _ in range(3 if cuda else 1)]
            self._ahead_turn = 0
        self.runs = 0  # proposals made by the padded steps (tests read it)
        self.replays = 0  # of those, replayed from a graph

    def _size(self, b: int) -> int:
        return (self.k + 1) * 4 * b + b

    def _split(self, flat: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's inputs: (fields [k + 1, 4, b], first tokens [b])."""
        n = (self.k + 1) * 4 * b
        return flat[:n].view(self.k + 1, 4, b), flat[n:n + b]

    def _steps(self, b: int) -> torch.Tensor:
        """Device work only (capturable): the k draft steps of bucket b → proposals [b, k]."""
        d = self.drafter
        fields, first = self._split(self.inputs, b)
        d.kv.req_to_slots[fields[:, 0], fields[:, 1]] = fields[:, 2].to(d.kv.req_to_slots.dtype)
        current, flat = d._ids(first), self.proposals.view(-1)
        for j in range(self.k):
            rows, positions, slots, lens = fields[j]
            batch = ForwardBatch(
                input_ids=current, positions=positions, out_slots=slots, decode_rows=rows,
                decode_seq_lens=lens, prefill_rows=self._empty, prefill_q_starts=self._empty,
                prefill_q_lens=self._empty, prefill_prefix_lens=self._empty, logits_index=self.logits_index[:b],
                num_decode=b, num_prefill_tokens=0, max_decode_len=self.max_len, every_token=True)
            # the decode graphs' greedy kernel (9 µs under torch.argmax + an index write at batch 1): the argmax is
            # the next step's input and lands in proposals[:, j], with no copy of its own
            current = ops.greedy_tokens(d.model.forward(batch, d.kv)[:, :d.vocab_size], self.proposal_index[j, :b], flat)
        return self.proposals[:b]

    def _fill(self, chunks: list[VerifyChunk], b: int) -> None:
        """Write the chunks' fields padded to bucket b and k steps (padding: scratch row, position 0, scratch
        slot, length 1)."""
        self._turn = (self._turn + 1) % len(self._host)
        flat = self._host[self._turn][:self._size(b)]
        fields, first = (t.numpy() for t in self._split(flat, b))
        fields[:, 0], fields[:, 1], fields[:, 2], fields[:, 3] = self.scratch_row, 0, self.scratch_slot, 1
        first[:] = 0
        for i, c in enumerate(chunks):
            n = len(c.slots)  # the last token and its proposal: wanted + 1 positions
            positions = np.arange(c.start, c.start + n)
            fields[:n, 0, i], fields[:n, 1, i], fields[:n, 2, i], fields[:n, 3, i] = c.row, positions, c.slots, positions + 1
            first[i] = c.token_ids[0]
        self.inputs[:self._size(b)].copy_(flat, non_blocking=True)

    def fits(self, chunks: list[VerifyChunk]) -> bool:
        return (0 < len(chunks) <= self.buckets[-1] and max(len(c.slots) for c in chunks) <= self.k + 1
                and max(c.start + len(c.slots) for c in chunks) <= self.max_len)

    @torch.inference_mode()
    def capture(self) -> None:
        with pdl.for_graphs():  # the warm-up compiles the PDL variants the capture records
            self.graphs = capture_buckets(self.buckets, lambda b: self._fill([], b), self._steps)
        log.info("captured the draft's CUDA graphs: %d steps for up to %d rows", self.k, self.buckets[-1])

    @torch.inference_mode()
    def run(self, chunks: list[VerifyChunk]) -> torch.Tensor:
        """Proposals [len(chunks), k] (a row's tokens past its own room are padding's); call when `fits`."""
        b = next(s for s in self.buckets if s >= len(chunks))
        self._fill(chunks, b)
        return self._launch(b, len(chunks))

    @torch.inference_mode()
    def run_ahead(self, chunks: list[VerifyChunk], verdict: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
        """Proposals [len(chunks), k] for the chunks' rows' next verify, enqueued right behind this step's greedy
        verdict (the chunks' [sum of their lengths], greedy_verdict's: kept tokens, -1 past them; the host has not
        read it): each row continues from its last token (`last_token`, which the verdict set) at start + kept, its
        K/V in the ahead slots, since the router has not allocated the next chunk's yet; the next step's mirror
        writes those positions into their own slots. Call when `fits` and built with `ahead_slot`."""
        b = next(s for s in self.buckets if s >= len(chunks))
        self._ahead_turn = (self._ahead_turn + 1) % len(self._ahead_host)
        flat = self._ahead_host[self._ahead_turn][:b * (self.k + 3)]
        host = flat.numpy()
        rows, starts, index = host[:b], host[b:2 * b], host[2 * b:].reshape(b, self.k + 1)
        rows[:], starts[:], index[:] = self.scratch_row, 0, -1
        offset = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            rows[i], starts[i] = c.row, c.start
            index[i, :n] = np.arange(offset, offset + n)
            offset += n
        ahead = self._ahead_in[:b * (self.k + 3)]
        ahead.copy_(flat, non_blocking=True)
        rows, starts, index = ahead[:b], ahead[b:2 * b], ahead[2 * b:].view(b, self.k + 1)
        kept = ((verdict[index.clamp(min=0)] >= 0) & (index >= 0)).sum(1)
        positions = (starts + kept)[None, :] + self._step_offsets  # [k + 1, b]
        # padding rows, and a row's steps past the steps' longest context (the graphs' bound, which may be short of
        # the model's: never a position of its own clamped to the bound, where its context may be), run on the
        # scratch row and slot (the model's graphs read the scratch row's table too): proposals for positions past
        # the bound, which a plan that `fits` does not verify
        inside = (rows != self.scratch_row)[None, :] & (positions < self.max_len)
        fields, first = self._split(self.inputs, b)
        fields[:, 0] = torch.where(inside, rows[None, :], self.scratch_row)
        fields[:, 1] = torch.where(inside, positions, 0)
        fields[:, 2] = torch.where(inside, self.ahead_slots[:, :b], self.scratch_slot)
        fields[:, 3] = fields[:, 1] + 1
        first.copy_(last_token[rows])
        return self._launch(b, len(chunks))

    def _launch(self, b: int, n: int) -> torch.Tensor:
        self.runs += 1
        if b not in self.graphs:
            return self._steps(b)[:n]
        graph, proposals = self.graphs[b]
        graph.replay()
        self.replays += 1
        return proposals[:n]
