"""The encoder servers of a multimodal model, read from the group of its kind: visual.* for a vision
model (Qwen2-VL), audio.* for an audio model (Qwen2-Audio). Both kinds run runtime/encoder/process.py;
this is the one place that picks the group, so the planner, rules and processes agree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EncoderServers:
    kind: str  # "visual" or "audio": the config group, and the plan's process names ({kind}.{i})
    dp: int  # server processes
    tp: int  # processes of one server (its tower split over them; audio: always 1)
    batch_size: int  # images or clips per forward pass
    devices: Optional[tuple[int, ...]]  # a GPU per process (dp × tp, server-major); None: the workers' GPUs in turn
    embed_cache_mib: int  # each server's embed cache

    def key(self, name: str) -> str:
        """The config key a user sets for this setting, e.g. key("dp") -> "audio.dp"."""
        return f"{self.kind}.{name}"


def multimodal(cfg) -> bool:
    return bool(cfg.model.vision or cfg.model.audio)


def encoder_servers(cfg) -> EncoderServers:
    """The servers' settings for cfg's model (audio.* if model.audio is set, else visual.*)."""
    if cfg.model.audio and not cfg.model.vision:
        a = cfg.audio
        return EncoderServers("audio", a.dp, 1, a.batch_size, tuple(a.devices) if a.devices is not None else None,
                              a.embed_cache_mib)
    v = cfg.visual
    return EncoderServers("visual", v.dp, v.tp, v.batch_size, tuple(v.devices) if v.devices is not None else None,
                          v.embed_cache_mib)
