"""Qwen2.5-VL's vision tower: Qwen2-VL's (runtime/models/vision_qwen2.py) with RMSNorm in place of
LayerNorm, a gated SiLU MLP (gate_proj, up_proj, down_proj) and window attention: the patches are
reordered window by window (windows of window_size pixels a side, in units of the m×m merge blocks),
every block but `fullatt_block_indexes` attends within its window, those attend over the whole frame,
and the merged tokens are put back in image order after the merger.

An image's embeddings do not depend on the images batched with it, bit for bit: in bfloat16 the 32 blocks of
the 7B tower amplify any rounding difference, even a 1e-7 relative one in a GEMM's float32 sums, to ~2.5%
of the embeddings (what bfloat16 costs against float32 in all), and on a GPU a kernel's choice (cuBLAS's
GEMM, attention's) depends on its shapes. So every call that sees a row count sees one image's rows
(norms, linears, the patch embedding and the merger run image by image; the full-attention blocks call
attention per image), and every window is padded to the full window and masked, whatever the batch.
Attention over the windows stays one call per block.

visual.tp > 1 splits it as Qwen2-VL's: heads column-parallel, gate‖up column-parallel, down_proj
row-parallel with an all-reduce.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, TpGroup
from llaunch.runtime.models.vision_qwen2 import Attend, Qwen2VisionTower, VisionArch, VisionBlock, segment_attention


def each_image(f: Callable, rows: list[int], *ts: torch.Tensor):
    """f over each image's rows of `ts` (their first dimension, images back to back) on their own, the
    results back to back (a tuple's members each): a GEMM rounds a row the same in any batch."""
    if len(rows) == 1:
        return f(*ts)
    outs = [f(*parts) for parts in zip(*(t.split(rows) for t in ts))]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(o) for o in zip(*outs))
    return torch.cat(outs)


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

    def forward(self, x, cos, sin, attend: Attend, rows: list[int] | None = None):
        """VisionBlock's, with everything but `attend` run over each of `rows` (a run of images) on its own."""
        rows = rows or [x.shape[0]]
        q, k, v = each_image(lambda x, cos, sin: self.qkv_rotary(self.norm1(x), cos, sin), rows, x, cos, sin)
        return each_image(self.finish, rows, x, attend(q, k, v).flatten(1))

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.proj(attended)
        return x + self.feed_forward(self.norm2(x))


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
    to `size`, its padding masked out of the keys. One call per block instead of one per run of equal
    windows (an image has a short window at the end of each window row). `size` is the full window's, not the
    batch's longest, and the mask is there even when no window is short (unmasked, a GPU takes another
    kernel): a window's attention is one computation in any batch (a 2x2-patch image's window, padded to its
    own 4 patches alone and to 16 in a batch, came out 1.1% apart in bfloat16: 4 small blocks, CPU)."""

    def __init__(self, lengths: list[int], size: int, device):
        pos = torch.arange(size)
        counts = torch.tensor(lengths)
        starts = torch.cumsum(counts, 0) - counts
        self.valid = (pos < counts[:, None]).to(device)  # [windows, size]
        self.index = torch.where(self.valid.cpu(), starts[:, None] + pos, 0).to(device)  # padding reads row 0
        self.mask = self.valid[:, None, None, :]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs, ks, vs = (t[self.index].transpose(1, 2) for t in (q, k, v))  # [windows, heads, size, head_dim]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask)
        return out.transpose(1, 2)[self.valid]  # the windows' tokens back to back, padding dropped


def frame_attention(grids: list[tuple[int, int, int]]) -> Attend:
    """Attention within each frame, one call per image (over its frames): a call's kernel and its split of
    the work may depend on the call's batch, which must not depend on the other images."""
    sizes = [t * h * w for t, h, w in grids]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([segment_attention(*qkv, lengths=[h * w] * t)
                          for qkv, (t, h, w) in zip(zip(*(x.split(sizes) for x in (q, k, v))), grids)])
    return attend


class Qwen2_5VisionTower(Qwen2VisionTower):
    """Qwen2VisionTower's contract (pixel_values, grids → embeddings in image order)."""

    block = WindowedVisionBlock

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        a = self.arch
        unit, side = a.spatial_merge_size ** 2, a.window_size // a.spatial_merge_size // a.patch_size
        order, windows = window_order(grids, a.spatial_merge_size, side)
        order = order.to(self.device)
        by_window = lambda t: t.view(-1, unit, t.shape[-1])[order].view(-1, t.shape[-1])  # noqa: E731
        # each image's rows stay together, in order, after the reordering (its windows never leave it);
        # with visual.tp > 1 the whole batch is one run: each row-parallel layer all-reduces once a pass
        # (runtime/encoder/tower_tp.py counts on it), and over more than two ranks NCCL's summation order
        # depends on the message's size anyway
        images = [t * h * w for t, h, w in grids]
        rows = images if self.tp.size == 1 else [sum(images)]
        x = by_window(each_image(self.embed, rows, pixel_values.to(self.device, self.dtype)))
        cos, sin = (by_window(t) for t in self._rotary(grids))
        frames, windows = frame_attention(grids), PaddedWindows([n * unit for n in windows], side * side * unit,
                                                                self.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in a.fullatt_block_indexes else windows, rows)
        return each_image(self.merge, rows, x)[torch.argsort(order)]


def tower_class(arch: VisionArch) -> type[Qwen2VisionTower]:
    return Qwen2_5VisionTower if arch.windowed else Qwen2VisionTower
