"""The start-up rules about the model: its family, checkpoint, description, dtype and context (the
others are launcher/rules.py's, which imports this module to register these)."""
from __future__ import annotations

import math
import os

from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Device, DType, LlaunchConfig, LoadFormat, Mode
from llaunch.runtime.models.checkpoint import is_gguf, read_checkpoint

FAMILIES = ("llama", "qwen2", "qwen2_vl", "qwen2_5_vl")  # qwen2_vl: Qwen2-VL (images; runtime/models/vision_qwen2.py),
# qwen2_5_vl: Qwen2.5-VL (its window-attention tower: runtime/models/vision_qwen2_5.py)
SIZED_PROFILES = "model=qwen2-0.5b | qwen2-7b | qwen2-72b | llama3-8b | tiny-qwen2 | tiny-llama"
SERVING_MODES = (Mode.normal, Mode.pd_prefill, Mode.pd_decode)  # modes that run workers


def serves(cfg: LlaunchConfig) -> bool:
    return cfg.mode.kind in SERVING_MODES


@rule(needs=("model.family",))
def family_supported(cfg):
    if cfg.model.family not in FAMILIES:
        yield ("model.family",), (f"model.family={cfg.model.family!r} is not served; llaunch runs "
                                  f"{' and '.join(FAMILIES)} checkpoints")


@rule()
def gguf_needs_gguf_path(cfg):
    m = cfg.model
    if m.load_format == LoadFormat.gguf and not is_gguf(m.path):
        yield ("model.load_format", "model.path"), (
            f"model.load_format=gguf needs a .gguf file in model.path, got model.path={m.path}")


@rule(live="warn")
def weights_need_path(cfg):
    m = cfg.model
    if not serves(cfg) or m.load_format == LoadFormat.dummy:
        return
    if m.path is None:
        yield ("model.path",), (
            f"model.path is required with model.load_format={m.load_format.value}: give "
            f"model.path=/path/to/checkpoint, or random weights of a known size: {SIZED_PROFILES} with "
            f"model.load_format=dummy")
    elif not os.path.exists(m.path):
        yield ("model.path",), (f"model.path={m.path} does not exist (SmolLM2: run scripts/prepare_models.py; "
                                "or set LLAUNCH_MODELS_DIR)")


@rule(live="warn")
def tokenizer_exists(cfg):
    t = cfg.model.tokenizer  # unset: the checkpoint's folder, or none at all for bare dummy weights
    if cfg.mode.kind != Mode.config_server and t is not None and not os.path.exists(t):
        yield ("model.tokenizer",), (f"model.tokenizer={t} does not exist (SmolLM2's: run "
                                     "scripts/prepare_models.py; or set LLAUNCH_MODELS_DIR)")


REQUIRED_FIELDS = ("family", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                   "rms_norm_eps", "max_model_len", "eos_token_ids")


@rule(live="skip")
def model_described(cfg):
    m = cfg.model
    if not serves(cfg) or (m.load_format != LoadFormat.dummy and not (m.path and os.path.exists(m.path))):
        return  # weights_need_path already asks for the checkpoint
    if unknown := [f"model.{f}" for f in REQUIRED_FIELDS if getattr(m, f) in (None, [])]:
        source = "the checkpoint does not say" if m.path else "dummy weights need the architecture"
        yield tuple(unknown), (f"{', '.join(unknown)} unknown ({source}): give model.path=/path/to/checkpoint, "
                               f"a sized profile ({SIZED_PROFILES}), or set them")


@rule()
def profile_matches_checkpoint(cfg):
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path else None
    if ckpt is None:
        return
    said = dict(ckpt.arch, family=ckpt.family)
    for name, value in said.items():
        ours = getattr(m, name)
        same = math.isclose(ours, value, rel_tol=1e-6) if isinstance(value, float) and ours is not None \
            else ours == value
        if ours is not None and not same:
            yield (f"model.{name}", "model.path"), (
                f"model.{name}={ours!r} but model.path={m.path} says {value!r}: the profile describes another "
                f"checkpoint; use model=qwen2 or model=llama (read everything from the checkpoint) or fix "
                f"model.{name}")


@rule()
def checkpoint_features_supported(cfg):
    ckpt = read_checkpoint(cfg.model.path) if cfg.model.path and serves(cfg) else None
    if ckpt is not None and ckpt.unsupported:
        yield ("model.path",), (f"model.path={cfg.model.path} uses {', '.join(ckpt.unsupported)}, which llaunch's "
                                f"{ckpt.family} model does not implement; serve another checkpoint")


@rule()
def checkpoint_dtype_supported(cfg):
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path else None
    if cfg.device == Device.cuda and m.dtype == DType.auto and ckpt is not None and ckpt.dtype:
        yield ("model.dtype",), (f"model.path={m.path} stores dtype {ckpt.dtype!r}, which llaunch does not run; set "
                                 "model.dtype=bfloat16 | float16 | float32")


@rule(needs=("model.max_model_len", "model.max_position_embeddings"))
def context_within_model(cfg):
    m = cfg.model
    if not 1 <= m.max_model_len <= m.max_position_embeddings:
        yield ("model.max_model_len", "model.max_position_embeddings"), (
            f"model.max_model_len={m.max_model_len} is outside 1..model.max_position_embeddings="
            f"{m.max_position_embeddings}: the model was not trained for longer contexts; lower "
            f"model.max_model_len or leave it unset")
