"""What one forward step computes, as tensors on the model's device (built by the worker's runner
from a StepPlan). Tokens are laid out decode-first: the first `num_decode` tokens are one new token
per decoding sequence, the rest are prefill chunks back to back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: KV cache slot each token's K/V is written to
    # decode part: tokens [0, num_decode)
    decode_rows: torch.Tensor  # [Bd] int32/int64: rows of req_to_slots
    decode_seq_lens: torch.Tensor  # [Bd]: cached tokens after this step (the new one included)
    # prefill part: tokens [num_decode, T)
    prefill_rows: torch.Tensor  # [Bp]
    prefill_q_starts: torch.Tensor  # [Bp]: offset of each chunk's first token in input_ids
    prefill_q_lens: torch.Tensor  # [Bp]
    prefill_prefix_lens: torch.Tensor  # [Bp]: tokens of the sequence already cached before the chunk
    logits_index: torch.Tensor  # [S]: token indices whose next-token logits are returned
    num_decode: int
    num_prefill_tokens: int
    max_prefill_len: int = 0  # host-side hints for kernels' grids (avoid a device sync)
    max_decode_len: int = 0
    every_token: bool = False  # logits_index is 0..T-1 (a decode-only step): no gather before the LM head
    # multimodal (runtime/worker/image_rows.py): M-RoPE positions [3, T] when a chunk holds image tokens,
    # and the image embeddings [N, hidden] that replace the tokens at image_index [N]
    mrope_positions: Optional[torch.Tensor] = None
    image_index: Optional[torch.Tensor] = None
    image_embeds: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_prefill_tokens


@dataclass
class KvCache:
    """Per-layer K and V buffers in token slots, and the per-request slot table."""

    k: list[torch.Tensor]  # per layer [num_slots, kv_heads_local, head_dim]
    v: list[torch.Tensor]
    req_to_slots: torch.Tensor  # [max_rows, max_model_len] int32

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]
