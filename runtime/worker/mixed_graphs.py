"""Piecewise CUDA graphs for the steps that carry prefill chunks beside decode rows (continuous batching's
mixed steps), or several chunks, or decode rows too long for the decode graphs: what neither the decode
graphs nor the lone-prefill graphs take.

Launched eagerly, such a step costs the host 20–43 ms of launches on the Qwen2-7B shape under load
(docs/performance.md), and only the step before it, often a 6 ms decode step, hides any of it: the
device waits. Its attention depends on each row's length and chunk layout, which a graph cannot hold;
everything between two attentions has fixed shapes for a token count. So, as vLLM v1 does, each step is
cut at its attentions: per token-count bucket one graph per piece (DecoderLM.piece: layer i - 1's o_proj,
norm and MLP, then layer i's norm and q/k/v projection with rotary and the K/V store), and the attentions
launched eagerly between the replays, reading q from and writing their output to static buffers. The
final norm and LM head run eagerly on the step's real rows.

A step is padded to its bucket: padding tokens embed a stale id at a stale position and store their K/V in
the scratch slot; no attention reads them, and each row of the pieces is computed on its own, so they
touch no real row. Without captured graphs (on a CPU) the same padded pieces run eagerly, which is how
the CPU tests check the padding.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from llaunch.runtime.models.batch import ForwardBatch, KvCache

log = logging.getLogger("llaunch.worker")


def bucket_sizes(max_tokens: int) -> list[int]:
    """Every 64 tokens up to 512, every 128 beyond (padding costs a large step under 3%), up to max_tokens
    rounded up; none for 0."""
    sizes, b = [], 64
    while max_tokens > 0 and (not sizes or sizes[-1] < max_tokens):
        sizes.append(b)
        b += 64 if b < 512 else 128
    return sizes


class MixedGraphs:
    def __init__(self, model, kv: KvCache, max_tokens: int, scratch_slot: int):
        self.model, self.kv = model, kv
        self.buckets = bucket_sizes(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.scratch_slot = scratch_slot
        self.layers = len(model.layers)
        attn = model.layers[0].self_attn
        device, dtype, t = kv.req_to_slots.device, model.dtype, self.max_tokens
        ints = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(t, **ints)
        self.positions = torch.zeros(t, **ints)
        self.slots = torch.full((t,), scratch_slot, **ints)
        heads = (t, attn.num_heads, attn.head_dim)
        self.q = torch.zeros(heads, dtype=dtype, device=device)
        self.attn = torch.zeros(heads, dtype=dtype, device=device)  # the attentions write here, between pieces
        self.residual = torch.zeros((t, model.arch.hidden_size), dtype=dtype, device=device)
        self.h = torch.zeros_like(self.residual)
        # an fp8 cache: the chunk's K/V unrounded, which prefill attention reads for the chunk itself
        fp8 = attn.kv_scales is not None
        kv_heads = (t, attn.num_kv_heads, attn.head_dim)
        self.k = torch.zeros(kv_heads, dtype=dtype, device=device) if fp8 else None
        self.v = torch.zeros(kv_heads, dtype=dtype, device=device) if fp8 else None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays = 0  # steps replayed from graphs

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether the step can replay: not too long, and no image (its embeddings and M-RoPE positions are
        the eager path's)."""
        return (0 < batch.num_tokens <= self.max_tokens and batch.image_index is None
                and batch.mrope_positions is None)

    def _piece(self, i: int, b: int) -> None:
        """Piece i of bucket b, from the static buffers into them."""
        m = self.model
        x = m.embed(self.ids[:b]) if i == 0 else self.attn[:b].view(b, -1)
        y, k, v, residual = m.piece(i, x, None if i == 0 else self.residual[:b], self.positions[:b], self.slots[:b],
                                    self.kv, m.rope_cos, m.rope_sin)
        self.residual[:b].copy_(residual)
        if i == self.layers:
            self.h[:b].copy_(y)
            return
        self.q[:b].copy_(y)
        if self.k is not None:
            self.k[:b].copy_(k)
            self.v[:b].copy_(v)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's pieces run once first on a side stream (Triton compiles each specialization), then
        are captured, largest bucket first, into one memory pool: a piece keeps nothing past its end (its
        outputs are copied into the static buffers), so every piece reuses the same pool memory."""
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.buckets:
                for i in range(self.layers + 1):
                    self._piece(i, b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        pool = None
        for b in reversed(self.buckets):
            graphs = []
            for i in range(self.layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, b)
                pool = pool or graph.pool()
                graphs.append(graph)
            self.graphs[b] = graphs
        torch.cuda.synchronize()
        log.info("captured mixed-step CUDA graphs for steps of up to %d tokens (%d buckets x %d pieces)",
                 self.max_tokens, len(self.buckets), self.layers + 1)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits, as DecoderLM.forward gives them: its pieces replayed at its bucket (or run
        eagerly where no graph was captured), its attentions and head launched between and after them."""
        m, kv, n = self.model, self.kv, batch.num_tokens
        b = next(size for size in self.buckets if size >= n)
        self.ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slots[:n].copy_(batch.out_slots, non_blocking=True)
        self.slots[n:b].fill_(self.scratch_slot)  # padding stores its K/V in the scratch slot
        graphs: Optional[list] = self.graphs.get(b)
        self.replays += graphs is not None
        for i in range(self.layers + 1):
            if graphs is None:
                self._piece(i, b)
            else:
                graphs[i].replay()
            if i < self.layers:
                m.layers[i].self_attn.attend(self.q[:b], None if self.k is None else self.k[:b],
                                             None if self.v is None else self.v[:b], batch, kv.k[i], kv.v[i],
                                             kv.req_to_slots, out=self.attn[:b])
        return m.head(self.h[:n], self.residual[:n], batch)
