"""CUDA graphs for a prompt's prefill when it runs alone: one chunk that ends the prompt, no decode
rows in the step. That is the step an idle server meets a new request with, so it sets the time to
first token at low load.

Launched eagerly, a 512-token prefill of the Qwen2-7B shape takes the host ~10 ms to enqueue its
~280 launches against ~13.7 ms on the device, and in the server, beside its other processes, up to
22 ms: the host, not the device, set the TTFT (docs/performance.md). A replay costs one copy and one
launch.

One graph per bucket of BUCKET tokens up to model.prefill_graph_tokens. A chunk is padded to its
bucket: padding tokens write their K/V to the scratch slot and their slot-table entry to the
scratch row, attention stops at the chunk's real length (read on the device), and only the chunk's
last real token reaches the LM head. `padded_batch` builds the same step for an eager forward, which
is how the CPU tests check the padding.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from llaunch.kernels import pdl
from llaunch.runtime.ipc.messages import PrefillChunk, StepPlan
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.worker.cuda_graphs import capture_buckets

log = logging.getLogger("llaunch.worker")

BUCKET = 64  # tokens: padding costs at most 63 tokens of device time, ~1.6 ms at the Qwen2-7B shape
TOKENS, CHUNK = 4, 5  # rows of the per-token block (ids, slot-table rows, positions, slots); chunk fields


def bucket_sizes(max_tokens: int) -> list[int]:
    """BUCKET, 2·BUCKET, … up to max_tokens rounded up to a whole bucket; none for 0."""
    top = -(-max_tokens // BUCKET) * BUCKET
    return list(range(BUCKET, top + 1, BUCKET))


class PrefillInputs:
    """One int64 buffer: per token [id, slot-table row, position, slot] × capacity, then the chunk's
    [row, start (cached prefix), length, index of its last token, 0 (its offset)]; one copy fills it."""

    def __init__(self, capacity: int, device: torch.device, pin: bool = False):
        self.capacity = capacity
        self.data = torch.zeros(TOKENS * capacity + CHUNK, dtype=torch.int64, device=device, pin_memory=pin)
        self.tokens = self.data[: TOKENS * capacity].view(TOKENS, capacity)
        self.chunk = self.data[TOKENS * capacity:]

    def fill(self, chunk: PrefillChunk, bucket: int, scratch_row: int, scratch_slot: int) -> None:
        """Host side: write a chunk padded to `bucket` (the tensor must be on the host)."""
        n = len(chunk.token_ids)
        t = self.tokens
        t[0, :n] = torch.tensor(chunk.token_ids, dtype=torch.int64)
        t[1, :n] = chunk.row
        t[2, :n] = torch.arange(chunk.start, chunk.start + n, dtype=torch.int64)
        t[3, :n] = torch.tensor(chunk.slots, dtype=torch.int64)
        t[0, n:bucket] = 0
        t[1, n:bucket] = scratch_row
        t[2, n:bucket] = 0
        t[3, n:bucket] = scratch_slot
        self.chunk.copy_(torch.tensor([chunk.row, chunk.start, n, n - 1, 0], dtype=torch.int64))


def padded_batch(inputs: PrefillInputs, bucket: int, kv: KvCache, empty: torch.Tensor) -> ForwardBatch:
    """Record the bucket's tokens in the slot table and describe the padded step (device work only,
    so it can be captured)."""
    ids, table_rows, positions, slots = (inputs.tokens[i, :bucket] for i in range(TOKENS))
    kv.req_to_slots[table_rows, positions] = slots.to(kv.req_to_slots.dtype)
    c = inputs.chunk
    return ForwardBatch(
        input_ids=ids, positions=positions, out_slots=slots, decode_rows=empty, decode_seq_lens=empty,
        prefill_rows=c[0:1], prefill_q_starts=c[4:5], prefill_q_lens=c[2:3],
        prefill_prefix_lens=c[1:2], logits_index=c[3:4], num_decode=0, num_prefill_tokens=bucket,
        max_prefill_len=bucket)


def alone_chunk(plan: StepPlan, max_tokens: int) -> Optional[PrefillChunk]:
    """The plan's one chunk if this step is a prompt's last (or only) chunk running alone and short
    enough for a graph; else None."""
    if plan.decode_rows or len(plan.prefill) != 1:
        return None
    chunk = plan.prefill[0]
    return chunk if chunk.sample and 0 < len(chunk.token_ids) <= max_tokens else None


class PrefillGraphs:
    def __init__(self, model, kv: KvCache, max_tokens: int, scratch_row: int, scratch_slot: int):
        self.model, self.kv = model, kv
        self.scratch_row, self.scratch_slot = scratch_row, scratch_slot
        self.buckets = bucket_sizes(max_tokens)
        self.max_tokens = self.buckets[-1]
        device = kv.req_to_slots.device
        self.inputs = PrefillInputs(self.max_tokens, device)
        # a ring of pinned host buffers: step N's copy may still be queued while N+1 is written (on
        # a CPU the inputs are written in place)
        cuda = device.type == "cuda"
        self._host = [PrefillInputs(self.max_tokens, torch.device("cpu"), pin=True) for _ in range(3)] if cuda \
            else [self.inputs]
        self._turn = 0
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _step(self, bucket: int) -> torch.Tensor:
        return self.model.forward(padded_batch(self.inputs, bucket, self.kv, self._empty), self.kv)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket with a one-token placeholder chunk in the scratch row and slot: the
        warm-up and the capture write only scratch K/V."""
        dummy = PrefillChunk(row=self.scratch_row, token_ids=[0], start=0, slots=[self.scratch_slot], sample=True)
        with pdl.for_graphs():
            self.graphs = capture_buckets(self.buckets, lambda b: self._fill(dummy, b), self._step)
        log.info("captured prefill CUDA graphs for chunks of up to %d tokens (%d buckets)", self.max_tokens,
                 len(self.buckets))

    def _fill(self, chunk: PrefillChunk, bucket: int) -> None:
        self._turn = (self._turn + 1) % len(self._host)
        host = self._host[self._turn]
        host.fill(chunk, bucket, self.scratch_row, self.scratch_slot)
        if host is not self.inputs:
            self.inputs.data.copy_(host.data, non_blocking=True)

    def run(self, chunk: PrefillChunk) -> torch.Tensor:
        """Logits [1, vocab] of the chunk's last token, its K/V written to its slots. The logits
        buffer is the graph's: read it (sampling, logprobs) before the next replay. Without a
        captured graph (on a CPU) the same padded step runs eagerly."""
        n = len(chunk.token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        self._fill(chunk, bucket)
        if bucket not in self.graphs:
            return self._step(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits
