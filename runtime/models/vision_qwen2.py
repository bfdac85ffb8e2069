"""Qwen2-VL's vision tower: patch embedding → N × (LayerNorm, attention with 2-D rotary, LayerNorm, MLP)
→ patch merger (2×2 patches → one language-model token). Images attend within themselves (one segment
per frame), bidirectionally. With visual.tp > 1 a visual replica splits each block Megatron-style (the
attention heads and the MLP's hidden features column-parallel, proj and fc2 row-parallel with an
all-reduce: runtime/models/layers.py); the patch embedding and the merger stay whole on every rank.

Parameter names are the checkpoint's under `visual.` (transformers' Qwen2VisionTransformerPretrainedModel),
so `checkpoint_layout` is a plain name map and runtime/models/weights.py loads it like the decoder.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, Shard, TpGroup


@dataclass(frozen=True)
class VisionArch:
    depth: int
    embed_dim: int
    hidden_size: int  # the language model's width: the merger's output
    num_heads: int
    mlp_ratio: float
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    in_channels: int = 3
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    intermediate_size: Optional[int] = None  # the MLP's hidden features; None: embed_dim × mlp_ratio
    window_size: Optional[int] = None  # Qwen2.5-VL: attention windows of this many pixels a side; None: Qwen2-VL
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend over whole frames

    @property
    def windowed(self) -> bool:
        """Qwen2.5-VL's tower (runtime/models/vision_qwen2_5.py): RMSNorm, gated MLP, window attention."""
        return self.window_size is not None

    @property
    def mlp_features(self) -> int:
        return self.intermediate_size or int(self.embed_dim * self.mlp_ratio)

    @classmethod
    def from_dict(cls, v: dict[str, Any]) -> "VisionArch":
        rope = v.get("rope_parameters") or {}
        return cls(depth=v["depth"], embed_dim=v["embed_dim"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
                   mlp_ratio=float(v.get("mlp_ratio", 4)), patch_size=v.get("patch_size", 14),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   temporal_patch_size=v.get("temporal_patch_size", 2), in_channels=v.get("in_channels", 3),
                   hidden_act=v.get("hidden_act", "quick_gelu"),
                   rope_theta=float(v.get("rope_theta", rope.get("rope_theta", 10000.0))),
                   intermediate_size=v.get("intermediate_size"), window_size=v.get("window_size"),
                   fullatt_block_indexes=tuple(v.get("fullatt_block_indexes") or ()))

    @property
    def num_params(self) -> int:
        e, m = self.embed_dim, self.mlp_features
        # gated MLP and RMSNorms (weights only) in Qwen2.5-VL's tower; fc1/fc2 and LayerNorms in Qwen2-VL's
        mlp, norm = (3 * e * m + 2 * m + e, e) if self.windowed else (2 * e * m + m + e, 2 * e)
        block = 4 * e * e + 4 * e + mlp + 2 * norm
        merged = e * self.spatial_merge_size ** 2
        return (self.depth * block + e * self.in_channels * self.temporal_patch_size * self.patch_size ** 2
                + norm + merged * merged + merged + merged * self.hidden_size + self.hidden_size)


_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "silu": F.silu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment of `lengths` ([tokens, heads, head_dim] in and out);
    runs of equal-length segments (same-size images) go as one batched call."""
    outs, start, i = [], 0, 0
    while i < len(lengths):
        n, j = lengths[i], i
        while j < len(lengths) and lengths[j] == n:
            j += 1
        end = start + (j - i) * n
        qs, ks, vs = (t[start:end].unflatten(0, (j - i, n)).transpose(1, 2) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).flatten(0, 1))
        start, i = end, j
    return torch.cat(outs)


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArch, device, dtype, tp: TpGroup = TpGroup(), name: str = ""):
        super().__init__()
        e, kw = a.embed_dim, dict(device=device, dtype=dtype)
        self.act = _ACTS[a.hidden_act]
        self.norm1, self.norm2 = self.make_norm(e, device, dtype), self.make_norm(e, device, dtype)
        self.attn, self.mlp = nn.Module(), nn.Module()
        if tp.size == 1:  # plain nn.Linear: the bias fused into the matmul, as transformers computes it
            self.num_heads = a.num_heads
            self.attn.qkv, self.attn.proj = nn.Linear(e, 3 * e, **kw), nn.Linear(e, e, **kw)
        else:
            head_dim = e // a.num_heads
            h0, self.num_heads = tp.split(a.num_heads, "visual num_heads")
            qkv = f"{name}.attn.qkv"  # the checkpoint's fused qkv: this rank's heads of each
            self.attn.qkv = ColumnParallelLinear(e, [(qkv, 3 * e, j * e + h0 * head_dim, self.num_heads * head_dim)
                                                     for j in range(3)], True, device, dtype)
            self.attn.proj = RowParallelLinear(f"{name}.attn.proj", e, h0 * head_dim, self.num_heads * head_dim, e,
                                               True, tp, device, dtype)
        self.make_mlp(a, tp, name, device, dtype)

    @staticmethod
    def make_norm(dim: int, device, dtype) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6, device=device, dtype=dtype)

    def make_mlp(self, a: VisionArch, tp: TpGroup, name: str, device, dtype) -> None:
        e, m = a.embed_dim, a.mlp_features
        if tp.size == 1:
            self.mlp.fc1, self.mlp.fc2 = (nn.Linear(e, m, device=device, dtype=dtype),
                                          nn.Linear(m, e, device=device, dtype=dtype))
            return
        f0, fn = tp.split(m, "visual MLP hidden features")
        self.mlp.fc1 = ColumnParallelLinear(e, [(f"{name}.mlp.fc1", m, f0, fn)], True, device, dtype)
        self.mlp.fc2 = RowParallelLinear(f"{name}.mlp.fc2", m, f0, fn, e, True, tp, device, dtype)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.fc2(self.act(self.mlp.fc1(x)))

    def qkv_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [tokens, embed_dim] → q, k, v [tokens, heads, head_dim], q and k rotated."""
        q, k, v = self.attn.qkv(x).reshape(x.shape[0], 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # float32, as transformers' apply_rotary_pos_emb_vision
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        return q, k, v

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.attn.proj(attend(*self.qkv_rotary(x, cos, sin)).reshape(x.shape[0], -1))

    def forward(self, x, cos, sin, attend: Attend):
        """`attend(q, k, v)`: attention within the segments this block attends over (frames, windows)."""
        x = x + self.attention(self.norm1(x), cos, sin, attend)
        return x + self.feed_forward(self.norm2(x))


class Qwen2VisionTower(nn.Module):
    """pixel_values [patches, C·T·P·P] (the image processor's) and grid_thw [(t, h, w)] per image →
    embeddings [Σ t·h·w / merge², hidden_size], images back to back."""

    block = VisionBlock  # Qwen2.5-VL's tower swaps in its own (runtime/models/vision_qwen2_5.py)

    def __init__(self, a: VisionArch, device, dtype, tp: TpGroup = TpGroup()):
        super().__init__()
        self.arch, self.device, self.dtype, self.tp = a, torch.device(device), dtype, tp
        kw = dict(device=device, dtype=dtype)
        e, merged = a.embed_dim, a.embed_dim * a.spatial_merge_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(a.in_channels, e, kernel_size=(a.temporal_patch_size, a.patch_size,
                                          a.patch_size), stride=(a.temporal_patch_size, a.patch_size, a.patch_size),
                                          bias=False, **kw)
        self.blocks = nn.ModuleList(self.block(a, device, dtype, tp, f"visual.blocks.{i}") for i in range(a.depth))
        self.merger = nn.Module()
        self.merger.ln_q = self.block.make_norm(e, device, dtype)
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged, **kw), nn.GELU(), nn.Linear(merged, a.hidden_size, **kw))
        head_dim = e // a.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def checkpoint_layout(self) -> dict[str, list[Shard]]:
        layout = {name: [Shard(f"visual.{name}", tuple(p.shape))] for name, p in self.named_parameters()}
        for mname, module in self.named_modules():  # tensor-parallel layers read their slices only
            if hasattr(module, "checkpoint_shards"):
                layout.update({f"{mname}.{k}": shards for k, shards in module.checkpoint_shards().items()})
        return layout

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        m, pos = self.arch.spatial_merge_size, []
        for t, h, w in grids:  # (h, w) of each patch, laid out block-major over the m×m merge blocks
            hh, ww = torch.meshgrid(torch.arange(h, device=self.device), torch.arange(w, device=self.device),
                                    indexing="ij")
            block = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(), ww.reshape(block).transpose(1, 2).flatten()], -1)
            pos.append(hw.repeat(t, 1))
        freqs = torch.cat(pos).float()[..., None] * self.inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[patches, C·T·P·P] → [patches, embed_dim]."""
        a = self.arch
        # The patch embedding is a Conv3d whose kernel equals its stride: a linear map of each flattened
        # patch, run here as one GEMM, as vLLM and SGLang do. cuDNN's Conv3d for this shape is known to be
        # very slow in bf16 (transformers issue 45750). Not measured here on its own.
        proj = self.patch_embed.proj
        return F.linear(pixel_values.to(self.device, self.dtype).view(-1, proj.weight[0].numel()),
                        proj.weight.view(a.embed_dim, -1), proj.bias)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, embed_dim] → [patches / merge², hidden_size]: each m×m block of patches, merged."""
        return self.merger.mlp(self.merger.ln_q(x).view(-1, self.arch.embed_dim * self.arch.spatial_merge_size ** 2))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.embed(pixel_values)
        cos, sin = self._rotary(grids)
        frames = partial(segment_attention, lengths=[h * w for t, h, w in grids for _ in range(t)])
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merge(x)
