"""Qwen2-Audio's audio tower: log-mel features → conv1d (k3) + GELU → conv1d (k3, stride 2) + GELU →
learned positions → N × (LayerNorm, attention, LayerNorm, MLP) → average pooling (2) → LayerNorm →
the multi-modal projector (one Linear to the language model's width). A clip attends within itself,
bidirectionally. Replicated on every rank (it is small next to the language model).

transformers pads every clip to 30 s (3,000 mel frames) and masks the attention keys past its length;
here a clip keeps only the frames its valid outputs read (`kept_frames`), so its outputs are the same
without the padding's work. Parameter names are the checkpoint's (`audio_tower.`, `multi_modal_projector.`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llaunch.runtime.models.layers import Shard


@dataclass(frozen=True)
class AudioArch:
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    hidden_size: int  # the language model's width: the projector's output
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    audio_token_id: int = 151646

    @classmethod
    def from_dict(cls, a: dict[str, Any]) -> "AudioArch":
        return cls(**{k: a[k] for k in cls.__dataclass_fields__ if k in a})

    @property
    def max_frames(self) -> int:  # 30 s of 10 ms mel frames
        return 2 * self.max_source_positions

    @property
    def num_params(self) -> int:
        d, f = self.d_model, self.encoder_ffn_dim
        layer = 4 * d * d + 3 * d + 2 * d * f + f + d + 4 * d
        return (self.encoder_layers * layer + 3 * d * self.num_mel_bins + d + 3 * d * d + d
                + self.max_source_positions * d + 2 * d + d * self.hidden_size + self.hidden_size)


def audio_tokens(frames: int) -> int:
    """Language-model tokens of a clip with `frames` valid mel frames (transformers' output lengths)."""
    return (conv_len(frames) - 2) // 2 + 1


def conv_len(frames: int) -> int:
    return (frames - 1) // 2 + 1


def kept_frames(frames: int, max_frames: int = 3000) -> int:
    """Mel frames (the clip's, then the extractor's padding) that its valid encoder outputs read."""
    return min(max_frames, 2 * conv_len(frames) + 1)


_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class AudioLayer(nn.Module):
    def __init__(self, a: AudioArch, device, dtype):
        super().__init__()
        d, kw = a.d_model, dict(device=device, dtype=dtype)
        self.num_heads = a.encoder_attention_heads
        self.act = _ACTS[a.activation_function]
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.v_proj = nn.Linear(d, d, **kw), nn.Linear(d, d, **kw)
        self.self_attn.k_proj = nn.Linear(d, d, bias=False, **kw)
        self.self_attn.out_proj = nn.Linear(d, d, **kw)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(d, **kw), nn.LayerNorm(d, **kw)
        self.fc1, self.fc2 = nn.Linear(d, a.encoder_ffn_dim, **kw), nn.Linear(a.encoder_ffn_dim, d, **kw)

    def attention(self, x: torch.Tensor, mask) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.self_attn.q_proj, self.self_attn.k_proj, self.self_attn.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.self_attn.out_proj(out.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x, mask):
        x = x + self.attention(self.self_attn_layer_norm(x), mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as transformers: keep fp16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class Qwen2AudioTower(nn.Module):
    """Clips' log-mel features ([num_mel_bins, kept_frames(frames)] each) and their valid frame counts →
    each clip's embeddings [audio_tokens(frames), hidden_size]."""

    def __init__(self, a: AudioArch, device, dtype):
        super().__init__()
        self.arch, self.device, self.dtype = a, torch.device(device), dtype
        kw = dict(device=device, dtype=dtype)
        d = a.d_model
        self.audio_tower = nn.Module()
        t = self.audio_tower
        t.conv1 = nn.Conv1d(a.num_mel_bins, d, kernel_size=3, padding=1, **kw)
        t.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1, **kw)
        t.embed_positions = nn.Embedding(a.max_source_positions, d, **kw)
        t.layers = nn.ModuleList(AudioLayer(a, device, dtype) for _ in range(a.encoder_layers))
        t.layer_norm = nn.LayerNorm(d, **kw)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(d, a.hidden_size, **kw)
        for p in self.parameters():
            p.requires_grad_(False)

    def checkpoint_layout(self) -> dict[str, list[Shard]]:
        return {name: [Shard(name, tuple(p.shape))] for name, p in self.named_parameters()}

    @torch.inference_mode()
    def forward(self, features: list[torch.Tensor], frames: list[int]) -> list[torch.Tensor]:
        t = self.audio_tower
        longest = max(f.shape[-1] for f in features)
        mel = torch.stack([F.pad(f.to(self.device, self.dtype), (0, longest - f.shape[-1])) for f in features])
        x = F.gelu(t.conv2(F.gelu(t.conv1(mel)))).transpose(1, 2)  # [clips, positions, d]
        lengths = [conv_len(n) for n in frames]
        x = x[:, :max(lengths)]
        x = x + t.embed_positions.weight[:x.shape[1]]
        mask = None
        if min(lengths) < x.shape[1]:  # a shorter clip's keys past its length are masked, as transformers'
            keys = torch.arange(x.shape[1], device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
            mask = keys[:, None, None, :]
        for layer in t.layers:
            x = layer(x, mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        x = self.multi_modal_projector.linear(t.layer_norm(x))
        return [x[i, :audio_tokens(n)] for i, n in enumerate(frames)]
