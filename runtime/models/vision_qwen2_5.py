"""Qwen2.5-VL's vision tower: Qwen2-VL's (runtime/models/vision_qwen2.py) with RMSNorm in place of
LayerNorm, a gated SiLU MLP (gate_proj, up_proj, down_proj) and window attention: the patches are
reordered window by window (windows of window_size pixels a side, in units of the m×m merge blocks),
every block but `fullatt_block_indexes` attends within its window, those attend over the whole frame,
and the merged tokens are put back in image order after the merger.

visual.tp > 1 splits it as Qwen2-VL's: heads column-parallel, gate‖up column-parallel, down_proj
row-parallel with an all-reduce.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, TpGroup
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower, VisionArch, VisionBlock, segment_attention


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2_5_VLRMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class WindowedVisionBlock(VisionBlock):
    @staticmethod
    def make_norm(dim: int, device, dtype) -> nn.Module:
        return VisionRMSNorm(dim, device=device, dtype=dtype)

    def make_mlp(self, a: VisionArch, tp: TpGroup, name: str, device, dtype) -> None:
        e, m, kw = a.embed_dim, a.mlp_features, dict(device=device, dtype=dtype)
        if tp.size == 1:  # the checkpoint's three Linears, as transformers computes them
            self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(e, m, **kw), nn.Linear(e, m, **kw)
            self.mlp.down_proj = nn.Linear(m, e, **kw)
            return
        f0, fn = tp.split(m, "visual MLP hidden features")
        self.mlp.gate_up = ColumnParallelLinear(e, [(f"{name}.mlp.gate_proj", m, f0, fn),
                                                    (f"{name}.mlp.up_proj", m, f0, fn)], True, device, dtype)
        self.mlp.down_proj = RowParallelLinear(f"{name}.mlp.down_proj", m, f0, fn, e, True, tp, device, dtype)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.mlp, "gate_up"):
            gate, up = self.mlp.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.mlp.gate_proj(x), self.mlp.up_proj(x)
        return self.mlp.down_proj(self.act(gate) * up)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged tokens' indices, window by window, frame by frame; each window's merged tokens): windows of
    `window` × `window` merged tokens, row-major, those at the right and bottom edges cut short
    (transformers' get_vision_window_index, its padding dropped)."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for frame in index:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = frame[r:r + window, c:c + window].flatten()
                    order.append(cell)
                    lengths.append(cell.numel())
        base += t * gh * gw
    return torch.cat(order), lengths


class PaddedWindows:
    """Attention within windows of the given lengths (back to back) as one batched call: every window padded
    to the longest, its padding masked out of the keys. One call per block instead of one per run of
    equal windows (an image has a short window at the end of each window row)."""

    def __init__(self, lengths: list[int], device):
        size = max(lengths)
        pos = torch.arange(size)
        counts = torch.tensor(lengths)
        starts = torch.cumsum(counts, 0) - counts
        self.valid = (pos < counts[:, None]).to(device)  # [windows, size]
        self.index = torch.where(self.valid.cpu(), starts[:, None] + pos, 0).to(device)  # padding reads row 0
        self.mask = None if min(lengths) == size else self.valid[:, None, None, :]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs, ks, vs = (t[self.index].transpose(1, 2) for t in (q, k, v))  # [windows, heads, size, head_dim]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask)
        return out.transpose(1, 2)[self.valid]  # the windows' tokens back to back, padding dropped


class Qwen2_5VisionTower(Qwen2VisionTower):
    """Qwen2VisionTower's contract (pixel_values, grids → embeddings in image order)."""

    block = WindowedVisionBlock

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        a = self.arch
        unit = a.spatial_merge_size ** 2
        order, windows = window_order(grids, a.spatial_merge_size, a.window_size // a.spatial_merge_size // a.patch_size)
        order = order.to(self.device)
        by_window = lambda t: t.view(-1, unit, t.shape[-1])[order].view(-1, t.shape[-1])  # noqa: E731
        x = by_window(self.embed(pixel_values))
        cos, sin = (by_window(t) for t in self._rotary(grids))
        # each frame's windows stay inside it: the frames are whole, in order, after the reordering
        frames = partial(segment_attention, lengths=[h * w for t, h, w in grids for _ in range(t)])
        windows = PaddedWindows([n * unit for n in windows], self.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in a.fullatt_block_indexes else windows)
        return self.merge(x)[torch.argsort(order)]


def tower_class(arch: VisionArch) -> type[Qwen2VisionTower]:
    return Qwen2_5VisionTower if arch.windowed else Qwen2VisionTower
