"""Qwen2-VL's M-RoPE: each token has three rotary positions (temporal, height, width); the head's
rotary frequencies are split into `mrope_section` runs, each rotated by one of the three.

Text tokens have three equal positions, so a decode token (or any text token) is plain RoPE at a
shifted position; only image tokens need the 3-D tables. Positions follow transformers'
`Qwen2VLModel.get_rope_index`: text counts up by one, an image's tokens are its (t, h, w) grid (after
the 2×2 merge) offset by the position where it starts, and the text after it resumes at
start + max(h, w) / merge.
"""
from __future__ import annotations

import torch


def rope_index(prompt_len: int, images: list[tuple[int, tuple[int, int, int]]], merge: int
               ) -> tuple[torch.Tensor, int]:
    """(positions [3, prompt_len] int64, delta): `images` are (offset of its first token, grid t·h·w in
    patches), in prompt order; a token at sequence index i ≥ prompt_len has position i + delta."""
    parts, pos, cursor = [], 0, 0
    for offset, (t, h, w) in images:
        if offset > cursor:
            parts.append(torch.arange(offset - cursor).expand(3, -1) + pos)
            pos += offset - cursor
        gt, gh, gw = t, h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        cursor = offset + gt * gh * gw
        pos += max(gh, gw)
    if prompt_len > cursor:
        parts.append(torch.arange(prompt_len - cursor).expand(3, -1) + pos)
        pos += prompt_len - cursor
    positions = torch.cat(parts, dim=1) if parts else torch.zeros((3, 0), dtype=torch.int64)
    return positions, pos - prompt_len


def mrope_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, sections: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin rows [T, head_dim / 2] for 3-D `positions` [3, T]: frequency run i reads
    axis i % 3 (transformers' recomposition). Index them with arange(T) as positions."""
    cos3, sin3 = cos[positions], sin[positions]  # [3, T, head_dim / 2]
    bounds, start = [], 0
    for i, n in enumerate(sections):
        bounds.append((i % 3, start, start + n))
        start += n
    pick = lambda t: torch.cat([t[axis, :, a:b] for axis, a, b in bounds], dim=-1)  # noqa: E731
    return pick(cos3), pick(sin3)
