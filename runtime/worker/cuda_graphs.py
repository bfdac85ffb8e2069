"""CUDA graphs for decode-only steps, one per batch-size bucket (gpt-fast's fixed shapes: the whole
forward of a decode step is replayed with one launch, so batch-1 decode is bound by the weights,
not by Python).

The graph reads static buffers: each decode row's id, position, new slot and length. Inside the
graph it records the new slots in `req_to_slots`, gathers each row's last sampled token, and ends
with the logits' argmax, recorded as each row's next last token, so an all-greedy step costs one
host→device copy, one replay and the tokens' copy back. Padding rows use a scratch row whose every
position maps to a scratch KV slot, which no request owns.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import pdl
from llaunch.runtime.models.batch import ForwardBatch, KvCache

log = logging.getLogger("llaunch.worker")


def capture_buckets(buckets: list[int], prepare: Callable[[int], None], step: Callable[[int], Any]) -> dict:
    """One CUDA graph per bucket: {bucket: (graph, what step(bucket) returned while captured)}.
    `prepare(b)` writes bucket b's placeholder inputs (they only have to be safe to compute on);
    `step(b)` enqueues its device work. Every bucket runs once first on a side stream, so Triton
    compiles each specialization before any capture; then the graphs are captured largest first,
    so the smaller ones reuse its memory pool. Call inside pdl.for_graphs() and inference mode."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in buckets:
            prepare(b)
            stream.synchronize()  # prepare's copies have landed before the next prepare rewrites their source
            step(b)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs, pool = {}, None
    for b in reversed(buckets):
        prepare(b)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step(b)
        if pool is None:
            pool = graph.pool()
        graphs[b] = (graph, out)
    torch.cuda.synchronize()
    return graphs


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes, b = [1, 2, 4], 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 256 else 32
    sizes.append(max_batch)
    return sorted({s for s in sizes if s <= max_batch})


class DecodeGraphs:
    def __init__(self, model, kv: KvCache, last_token: torch.Tensor, max_batch: int, max_model_len: int,
                 scratch_row: int, scratch_slot: int):
        self.model, self.kv, self.last_token = model, kv, last_token
        self.scratch_row, self.scratch_slot = scratch_row, scratch_slot
        self.max_model_len = max_model_len
        self.buckets = bucket_sizes(max_batch)
        device = last_token.device
        n = self.buckets[-1]
        # rows, positions, slots, seq_lens: a bucket of b rows reads the first 4·b elements as [4, b],
        # so one step's inputs are one contiguous pinned copy (a strided one is staged through pageable memory)
        self.inputs = torch.zeros(4 * n, dtype=torch.int64, device=device)
        self._host = [torch.zeros(4 * n, dtype=torch.int64).pin_memory() for _ in range(3)]
        self._host_turn = 0
        self.logits_index = torch.arange(n, dtype=torch.int64, device=device)
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.replays = 0  # decode steps served from a graph (tests and traces read it)

    def _step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, positions, slots, lens = self.inputs[: 4 * b].view(4, b)
        self.kv.req_to_slots[rows, positions] = slots.to(self.kv.req_to_slots.dtype)
        batch = ForwardBatch(
            input_ids=self.last_token[rows], positions=positions, out_slots=slots,
            decode_rows=rows, decode_seq_lens=lens, prefill_rows=self._empty, prefill_q_starts=self._empty,
            prefill_q_lens=self._empty, prefill_prefix_lens=self._empty, logits_index=self.logits_index[:b],
            num_decode=b, num_prefill_tokens=0, max_decode_len=self.max_model_len, every_token=True)
        logits = self.model.forward(batch, self.kv)
        # greedy tokens inside the graph, recorded as each row's last token (a sampling step writes
        # its own over them): an all-greedy step then needs no kernels of its own between replays
        tokens = ops.greedy_tokens(logits, rows, self.last_token)
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        with pdl.for_graphs():  # the warm-up compiles the PDL variants the capture records
            self.graphs = capture_buckets(self.buckets, self._fill_padding, self._step)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _fill_padding(self, b: int) -> None:
        """Before a bucket's warm-up and capture: all of its b rows are padding (scratch K/V only)."""
        flat = self._host[self._host_turn][: 4 * b]
        host = flat.view(4, b)
        host[0], host[1], host[2], host[3] = self.scratch_row, 0, self.scratch_slot, 1
        self.inputs[: 4 * b].copy_(flat)

    def fits(self, num_decode: int, longest: int) -> bool:
        """A decode step replays a graph when a bucket holds its rows and its longest context is within
        the graphs' (their attention grid is sized for `max_model_len`)."""
        return 0 < num_decode <= self.buckets[-1] and longest <= self.max_model_len

    def run(self, rows: list[int], positions: list[int], slots: list[int], lens: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [len(rows), vocab] of a decode-only step, and their argmax [len(rows)], which the
        graph has also written to each row's last token."""
        n = len(rows)
        b = next(s for s in self.buckets if s >= n)
        # a ring of pinned buffers: the copy of step N may still be queued while N+1 is prepared
        self._host_turn = (self._host_turn + 1) % len(self._host)
        flat = self._host[self._host_turn][: 4 * b]
        host = flat.view(4, b)
        host[0, :n] = torch.tensor(rows, dtype=torch.int64)
        host[1, :n] = torch.tensor(positions, dtype=torch.int64)
        host[2, :n] = torch.tensor(slots, dtype=torch.int64)
        host[3, :n] = torch.tensor(lens, dtype=torch.int64)
        host[0, n:b] = self.scratch_row
        host[1, n:b] = 0
        host[2, n:b] = self.scratch_slot
        host[3, n:b] = 1
        self.inputs[: 4 * b].copy_(flat, non_blocking=True)
        graph, (logits, tokens) = self.graphs[b]
        graph.replay()
        self.replays += 1
        return logits[:n], tokens[:n]
