"""The start-up rules about quantized weights and the fp8 KV cache: a checkpoint whose
quantization_config llaunch does not implement is refused (read as plain weights it serves wrong
text), as is a tensor-parallel split that cuts a block-wise checkpoint's blocks of input columns,
and the fp8 switches are checked against each other (launcher/rules.py imports this module)."""
from __future__ import annotations

import os

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import KvDType, LoadFormat, Mode
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.heads import HeadLayout
from llaunch.runtime.models.quant_scheme import SUPPORTED, WeightQuant, splits_blocks


@rule()
def checkpoint_quantization_supported(cfg):
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path and serves(cfg) and m.load_format != LoadFormat.dummy else None
    q = ckpt.weight_quant if ckpt is not None else None
    if q is not None and not q.served:
        yield ("model.path",), (
            f"model.path={m.path} is quantized with {q.method} ({'; '.join(q.problems)}) per its config.json "
            f"quantization_config, which llaunch does not implement; llaunch serves {SUPPORTED}. Serve the "
            f"unquantized checkpoint instead (model.quantization=fp8 or int8 quantizes it at load)")
    elif q is not None and m.quantization is not None:
        yield ("model.quantization", "model.path"), (
            f"model.quantization={m.quantization.value} quantizes a 16- or 32-bit checkpoint at load, and "
            f"model.path={m.path} already holds {q.method} weights (config.json quantization_config), which are "
            f"served as they are: unset model.quantization, or serve the unquantized checkpoint")
    elif q is not None and q.block is not None:
        yield from _blocks_split_whole(cfg, q)


def _cut_layers(cfg, q: WeightQuant, tp: int) -> list[str]:
    """The row-parallel layers whose input columns `tp` ranks would hold in pieces that cut q's blocks
    (each rank quantizes its activations per block of columns: fp8_linear.Fp8RowParallelLinear)."""
    m, cols = cfg.model, q.block[1]
    layout = HeadLayout.of(m.num_attention_heads, m.num_key_value_heads, tp)
    cut = []
    if any(splits_blocks([(None if h is None else h * m.head_dim, n * m.head_dim) for h, n in layout.query_runs(r)],
                         cols) for r in range(tp)):
        heads = layout.heads_per_rank
        cut.append(f"o_proj ({m.head_dim * heads} columns a rank: {heads} head{'s' * (heads != 1)} of {m.head_dim})")
    if m.intermediate_size % tp == 0:
        share = m.intermediate_size // tp
        if any(splits_blocks([(r * share, share)], cols) for r in range(tp)):
            cut.append(f"down_proj ({share} of intermediate_size={m.intermediate_size} a rank)")
    return cut


def _blocks_split_whole(cfg, q: WeightQuant):
    m, p = cfg.model, cfg.parallel
    dims = (m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.intermediate_size)
    if None in dims or p.tp < 1 or m.num_attention_heads % m.num_key_value_heads:
        return  # model_described and tp_splits_heads report these
    cut = _cut_layers(cfg, q, p.tp)
    if cut:
        ok = [t for t in range(1, max(8, p.tp) + 1) if m.intermediate_size % t == 0 and not _cut_layers(cfg, q, t)
              and (p.pad_heads or not HeadLayout.of(m.num_attention_heads, m.num_key_value_heads, t).padded)]
        yield ("model.path", "parallel.tp"), (
            f"model.path={m.path} holds fp8 weights in blocks of {q.block[0]}x{q.block[1]} (config.json "
            f"quantization_config), and parallel.tp={p.tp} splits the input columns of {' and '.join(cut)} "
            f"inside a block: each rank quantizes its activations per block of {q.block[1]} columns, so a rank's "
            f"columns must begin on a block. Use parallel.tp of {', '.join(map(str, ok)) or 'none up to 8'}")


@rule()
def lm_head_one_format(cfg):
    if cfg.model.fp8_lm_head and cfg.model.int8_lm_head:
        yield ("model.fp8_lm_head", "model.int8_lm_head"), (
            "model.fp8_lm_head=true and model.int8_lm_head=true: the LM head is stored one way; pick e4m3 "
            "(fp8_lm_head, inputs quantized too) or int8 (int8_lm_head, weight-only, closer to the 16-bit head)")


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

