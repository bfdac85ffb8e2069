"""Tensor-parallel building blocks: each holds only its rank's shard and says, as `Shard`s, which
slice of which checkpoint tensor fills it, so loaders read only that slice.

Megatron layout: column-parallel layers split output features (no communication), row-parallel
layers split input features and all-reduce their output; the vocabulary is split across ranks for
both the embedding (masked lookup + all-reduce) and the LM head (all-gather of logits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llaunch.kernels.dispatch import linear, lm_head_linear, rmsnorm
from llaunch.kernels import int8
from llaunch.kernels.fp8 import FP8, Fp8Weight, quantize_weight


@dataclass(frozen=True)
class Shard:
    """The slice of checkpoint tensor `name` (full shape `full_shape`) that fills part of a local
    parameter: rows/cols [start, start + size) along `dim`, or the whole tensor when dim is None.
    A parameter made of several Shards (fused q/k/v, gate/up; o_proj's columns around zero heads) is
    their concatenation along dim 0, or dim 1 when the shards split dim 1. A shard named "" is
    padding: zeros, read from no file. `plus` is added to every value read (in float32, before the
    parameter's dtype): Gemma's norms store w for a scale of 1 + w."""

    name: str
    full_shape: tuple[int, ...]
    dim: Optional[int] = None
    start: int = 0
    size: int = 0
    plus: float = 0.0

    @property
    def padding(self) -> bool:
        return self.name == ""

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.size
        return tuple(shape)


@dataclass(frozen=True)
class TpGroup:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of n items."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {self.size}")
        size = n // self.size
        return self.rank * size, size


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over ranks. Several checkpoint matrices can be
    fused into one (q‖k‖v, gate‖up): `parts` lists (checkpoint prefix, full out features, local
    start, local size) in output order; a prefix of None makes zero rows (padded heads)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, int, int]], bias: bool,
                 device, dtype):
        super().__init__()
        self.parts = parts
        self.in_features = in_features
        out_local = sum(p[3] for p in parts)
        self.weight = _param((out_local, in_features), device, dtype)
        self.bias = _param((out_local,), device, dtype) if bias else None

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        name = lambda n, what: "" if n is None else f"{n}.{what}"  # noqa: E731
        shards = {"weight": [Shard(name(n, "weight"), (full, self.in_features), 0, s, k) for n, full, s, k in self.parts]}
        if self.bias is not None:
            shards["bias"] = [Shard(name(n, "bias"), (full,), 0, s, k) for n, full, s, k in self.parts]
        return shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) (+ b): W's input columns [in_start, in_start + in_local)
    live on this rank, or the runs `in_parts` lists as (start or None for zero columns, size); the
    bias is added once, after the reduction."""

    def __init__(self, name: str, in_features: int, in_start: int, in_local: int, out_features: int,
                 bias: bool, tp: TpGroup, device, dtype, in_parts: Optional[list[tuple[Optional[int], int]]] = None):
        super().__init__()
        self.name, self.tp = name, tp
        self.full_shape = (out_features, in_features)
        self.in_parts = in_parts or [(in_start, in_local)]
        self.weight = _param((out_features, sum(n for _, n in self.in_parts)), device, dtype)
        self.bias = _param((out_features,), device, dtype) if bias else None

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        shards = {"weight": [Shard("" if s is None else f"{self.name}.weight", self.full_shape, 1, s or 0, n)
                             for s, n in self.in_parts]}
        if self.bias is not None:
            shards["bias"] = [Shard(f"{self.name}.bias", (self.full_shape[0],))]
        return shards

    def forward(self, x: torch.Tensor, reduce: bool = True, unscaled: bool = False):
        """reduce=False: this rank's partial sum, for a caller that adds others to it before one all-reduce
        (an MoE block's shared expert); it adds the bias too, once, after reducing. unscaled: the caller hands the
        output to the next RMSNorm with the residual, so on one rank without a bias an fp8 layer may return its
        ScaledSums (kernels.fp8_norm_epilogue)."""
        if not reduce:
            return linear(x, self.weight)
        if unscaled and self.tp.size == 1 and self.bias is None:
            return linear(x, self.weight, unscaled=True)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into equal blocks of ceil(vocab / tp) rows; the
    last rank's block is zero-padded so every rank's LM-head logits have the same width."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int, tp: TpGroup, device, dtype):
        super().__init__()
        self.name, self.tp, self.vocab_size, self.hidden_size = name, tp, vocab_size, hidden_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = min(tp.rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _param((self.rows_per_rank, hidden_size), device, dtype)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        return {"weight": [Shard(f"{self.name}.weight", (self.vocab_size, self.hidden_size), 0,
                                 self.vocab_start, self.vocab_end - self.vocab_start)]}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


def quantize_by_rows(weight: torch.Tensor, dtype: torch.dtype, quantize, rows_at_once: int):
    """weight's rows as `dtype` and a float32 scale a row, `quantize` (kernels/int8.quantize_rows or its e4m3 twin)
    applied to a block of rows at a time: the float32 copies it makes are then a block's, not the whole weight's."""
    q = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_at_once):
        q[start:start + rows_at_once], scale[start:start + rows_at_once] = quantize(weight[start:start + rows_at_once])
    return q, scale


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary block of this rank, all-gathered to [N, vocab] float32. Tied to
    the embedding (shares its weight, so no checkpoint tensor of its own) or its own weight; after
    quantize_fp8 (model.fp8_lm_head) an e4m3 copy with a scale per vocabulary row, after quantize_int8
    (model.int8_lm_head) an int8 one."""

    def __init__(self, name: str, embedding: VocabParallelEmbedding, tied: bool, device, dtype):
        super().__init__()
        self.embedding = [embedding]  # a list, so the tied weight is not registered twice
        self.vocab_size = embedding.vocab_size
        self.tp = embedding.tp
        self.weight = None if tied else _param(embedding.weight.shape, device, dtype)
        self.name = name
        self.register_buffer("qweight", None)  # model.fp8_lm_head / int8_lm_head: e4m3 or int8 [rows, hidden]
        self.register_buffer("weight_scale", None)  # and a float32 scale per row

    def quantize_fp8(self) -> None:
        """The head's weight to e4m3 with a float32 scale per vocabulary row (kernels/fp8.quantize_weight)."""
        self._quantize(FP8, quantize_weight)

    def quantize_int8(self) -> None:
        """The head's weight to int8 with a float32 scale per vocabulary row (kernels/int8.quantize_rows)."""
        self._quantize(torch.int8, int8.quantize_rows)

    @torch.no_grad()
    def _quantize(self, dtype: torch.dtype, quantize, rows_at_once: int = 16384) -> None:
        """The head's weight to `dtype` rows and a float32 scale a row, a block of rows at a time so the float32
        copy of only that block is alive. Its own weight's 16-bit copy is freed; a tied embedding keeps its copy for
        the lookup (the head then holds one byte more a weight)."""
        weight = self.embedding[0].weight if self.weight is None else self.weight
        self.qweight, self.weight_scale = quantize_by_rows(weight, dtype, quantize, rows_at_once)
        self.weight = None

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        if self.weight is None:
            return {}
        emb = self.embedding[0].checkpoint_shards()["weight"][0]
        return {"weight": [Shard(f"{self.name}.weight", emb.full_shape, 0, emb.start, emb.size)]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and self.qweight.dtype == torch.int8:
            weight = int8.Int8Rows(self.qweight, self.weight_scale)
        elif self.qweight is not None:
            weight = Fp8Weight(self.qweight, self.weight_scale)
        else:
            weight = self.embedding[0].weight if self.weight is None else self.weight
        logits = self.tp.all_gather_last_dim(lm_head_linear(x, weight).float())
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm whose call can fuse the residual add: (norm(x + residual), x + residual). unit_offset: the
    checkpoint holds w of Gemma's (1 + w) scale; the parameter holds 1 + w (computed in float32 as transformers
    does: equal to its float32 model; a 16-bit model rounds the normalized value and 1 + w apart, the Llama way)."""

    def __init__(self, name: str, hidden_size: int, eps: float, device, dtype, unit_offset: bool = False):
        super().__init__()
        self.name, self.eps, self.unit_offset = name, eps, unit_offset
        self.weight = _param((hidden_size,), device, dtype)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        plus = 1.0 if self.unit_offset else 0.0
        return {"weight": [Shard(f"{self.name}.weight", tuple(self.weight.shape), plus=plus)]}

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, into=None):
        """`into`: the weight of the layer this norm feeds (an fp8 layer may take its input quantized by it)."""
        return rmsnorm(x, self.weight, self.eps, residual, into=into)
