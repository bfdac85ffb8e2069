"""An fp8 KV cache (cache.kv_dtype=fp8_e4m3): the model's KV dtype becomes float8_e4m3fn and each
attention layer gets its K and V scales: cache.kv_scales's file, else 1.0 (K/V beyond ±448 saturate;
Llama/Qwen2 K and V stay well inside that). With cache.kv_calibration every layer records its K/V
absmax as tokens are stored, and `KvCalibration` merges them into the file every WRITE_PERIOD_S while
they change (a worker is stopped by a signal: there may be no "exit" to write at) and at a clean exit.

The scales file: {"k_scale": [per layer], "v_scale": [...], "k_absmax": [...], "v_absmax": [...],
"run": run dir}. Every rank and replica of one run merges into it (max), under a file lock.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import threading
import time
from typing import Optional

import torch

from llaunch.kernels.fp8 import FP8, FP8_MAX
from llaunch.kernels.kv_fp8 import KvScales
from llaunch.runtime.config import CacheConfig, KvDType

DEFAULT_SCALE = 1.0
WRITE_PERIOD_S = 2.0


def read_scales(path: str, num_layers: int) -> tuple[list[float], list[float]]:
    """A scales file's per-layer K and V scales, checked."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for key in ("k_scale", "v_scale"):
        values = data.get(key)
        if not isinstance(values, list) or len(values) != num_layers:
            raise ValueError(f"cache.kv_scales={path}: {key} must list {num_layers} scales (one per layer)")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"cache.kv_scales={path}: {key} holds a scale that is not a positive number")
        out.append([float(v) for v in values])
    return out[0], out[1]


def scale_of(absmax: float) -> float:
    """The scale that maps absmax to e4m3's largest value (1.0 for a layer that saw nothing)."""
    return absmax / FP8_MAX if absmax > 0 else DEFAULT_SCALE


class KvCalibration:
    """The running absmax of every layer's K and V, written to cache.kv_calibration's file."""

    def __init__(self, path: str, run_id: str, layers: list[KvScales]):
        self.path, self.run_id, self.layers = path, run_id, layers
        self._written: Optional[tuple] = None

    def start(self) -> "KvCalibration":
        """Write the file in a daemon thread whenever the absmax moved, every WRITE_PERIOD_S."""
        def loop():
            while True:
                time.sleep(WRITE_PERIOD_S)
                self.write(partial=False)

        threading.Thread(target=loop, name="kv-calibration", daemon=True).start()
        return self

    def absmax(self) -> tuple[list[float], list[float]]:
        return [s.k_amax.item() for s in self.layers], [s.v_amax.item() for s in self.layers]

    def write(self, partial: bool = True) -> None:
        """The file from the running absmax. partial=False (the periodic writes): only once every layer has stored
        K and V: the thread reads the layers while a forward updates them one by one, and a layer the first
        forward had not reached yet would be written as one that saw nothing (scale 1.0). The last write, at exit,
        takes what there is."""
        k, v = self.absmax()
        if self._written == (k, v) or not any(k):  # unchanged, or nothing stored yet
            return
        if not partial and not (all(k) and all(v)):
            return
        self._written = (k, v)
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks and replicas of this run merge into it too
            try:
                with open(self.path) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = {}
            if old.get("run") == self.run_id and len(old.get("k_absmax", [])) == len(k):
                k = [max(a, b) for a, b in zip(k, old["k_absmax"])]
                v = [max(a, b) for a, b in zip(v, old["v_absmax"])]
            data = {"k_scale": [scale_of(a) for a in k], "v_scale": [scale_of(a) for a in v],
                    "k_absmax": k, "v_absmax": v, "run": self.run_id}
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)


def use_fp8_kv(model, cache: CacheConfig, run_id: str = "") -> Optional[KvCalibration]:
    """Make `model`'s KV cache fp8 as `cache` says (before make_kv_cache and KV sizing); the
    calibration to write at exit, when cache.kv_calibration is set. Nothing for kv_dtype=auto."""
    if cache.kv_dtype != KvDType.fp8_e4m3:
        return None
    attns = [layer.self_attn for layer in model.layers]
    k, v = read_scales(cache.kv_scales, len(attns)) if cache.kv_scales else ([DEFAULT_SCALE] * len(attns),) * 2
    model.kv_dtype = FP8
    layers = []
    for attn, ks, vs in zip(attns, k, v):
        scalar = lambda x: torch.tensor(x, dtype=torch.float32, device=model.device)  # noqa: E731
        amax = cache.kv_calibration is not None
        attn.kv_scales = KvScales(scalar(ks), scalar(vs), scalar(0.0) if amax else None, scalar(0.0) if amax else None)
        layers.append(attn.kv_scales)
    return KvCalibration(cache.kv_calibration, run_id, layers) if cache.kv_calibration else None
