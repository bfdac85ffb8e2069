"""The start-up rules about quantized weights and the fp8 KV cache: a checkpoint whose
quantization_config llaunch does not implement is refused (read as plain weights it serves wrong
text), and the fp8 switches are checked against each other (launcher/rules.py imports this module)."""
from __future__ import annotations

import os

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import KvDType, LoadFormat, Mode
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.quant_scheme import SUPPORTED


@rule()
def checkpoint_quantization_supported(cfg):
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path and serves(cfg) and m.load_format != LoadFormat.dummy else None
    q = ckpt.weight_quant if ckpt is not None else None
    if q is not None and not q.served:
        yield ("model.path",), (
            f"model.path={m.path} is quantized with {q.method} ({'; '.join(q.problems)}) per its config.json "
            f"quantization_config, which llaunch does not implement; llaunch serves {SUPPORTED}. Serve the "
            f"unquantized checkpoint instead (model.quantization=fp8 quantizes it at load)")


@rule()
def kv_scales_need_fp8(cfg):
    c = cfg.cache
    if (c.kv_scales or c.kv_calibration) and c.kv_dtype != KvDType.fp8_e4m3:
        yield ("cache.kv_scales", "cache.kv_calibration", "cache.kv_dtype"), (
            f"cache.kv_scales={c.kv_scales} / cache.kv_calibration={c.kv_calibration} scale an fp8 KV cache but "
            f"cache.kv_dtype={c.kv_dtype.value}: set cache.kv_dtype=fp8_e4m3 or unset them")
    if c.kv_scales and c.kv_calibration:
        yield ("cache.kv_scales", "cache.kv_calibration"), (
            "cache.kv_scales and cache.kv_calibration are both set: calibrate with the default scales (1.0) "
            "first, then load the file it wrote with cache.kv_scales")


@rule(live="warn")
def kv_scales_file_exists(cfg):
    path = cfg.cache.kv_scales
    if path and not os.path.isfile(path):
        yield ("cache.kv_scales",), (f"cache.kv_scales={path} does not exist: write it with "
                                     "cache.kv_calibration=PATH first")


@rule()
def fp8_kv_not_in_pd(cfg):
    if cfg.cache.kv_dtype == KvDType.fp8_e4m3 and cfg.mode.kind in (Mode.pd_prefill, Mode.pd_decode):
        yield ("cache.kv_dtype", "mode.kind"), (
            f"cache.kv_dtype=fp8_e4m3 with mode.kind={cfg.mode.kind.value}: the KV transfer between prefill and "
            "decode instances moves the model's dtype only; use cache.kv_dtype=auto")

