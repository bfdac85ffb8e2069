"""The start-up rules about the model: its family, checkpoint, description, dtype, rotary scaling and
context (the others are launcher/rules.py's, which imports this module to register these)."""
from __future__ import annotations

import math
import os

from llaunch.launcher import store
from llaunch.launcher.derive import is_url
from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Device, DType, LlaunchConfig, LoadFormat, Mode
from llaunch.runtime.models import rope
from llaunch.runtime.models.arch import FAMILIES  # qwen2_vl / qwen2_5_vl: Qwen2-VL / Qwen2.5-VL (images)
from llaunch.runtime.models.checkpoint import is_gguf, read_checkpoint
from llaunch.runtime.models.decoder_variants import ACTIVATIONS, LAYER_TYPES

GGUF_FAMILIES = ("llama", "qwen2")  # GGUF's general.architecture that runtime/models/weights.py reads (Mistral's is llama)
SIZED_PROFILES = ("model=qwen2-0.5b | qwen2-7b | qwen2-72b | qwen3-8b | llama3-8b | mistral-7b | gemma3-12b | phi4 | "
                  "qwen3-30b-a3b | mixtral-8x7b | tiny-qwen2 | tiny-llama")
SERVING_MODES = (Mode.normal, Mode.pd_prefill, Mode.pd_decode)  # modes that run workers


def serves(cfg: LlaunchConfig) -> bool:
    return cfg.mode.kind in SERVING_MODES


@rule(needs=("model.family",))
def family_supported(cfg):
    if cfg.model.family not in FAMILIES:
        yield ("model.family",), (f"model.family={cfg.model.family!r} is not served; llaunch runs "
                                  f"{', '.join(FAMILIES)} checkpoints (config.json's model_type)")


@rule(needs=("model.family",))
def gguf_family_served(cfg):
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path and is_gguf(m.path) else None
    if ckpt is not None and m.family not in GGUF_FAMILIES:
        yield ("model.path", "model.family"), (
            f"model.path={m.path} is a GGUF of model.family={m.family!r}; llaunch reads GGUF files of "
            f"{' and '.join(GGUF_FAMILIES)} (Mistral's too); serve the Hugging Face checkpoint instead")


def rotary_dim(m) -> int | None:
    return rope.rotary_dim(m.head_dim, m.partial_rotary_factor)


@rule()
def rope_scaling_supported(cfg):
    m = cfg.model
    if problems := rope.rope_problems(m.rope_scaling, rotary_dim(m)):
        yield ("model.rope_scaling",), (
            f"model.rope_scaling={m.rope_scaling!r}: {'; '.join(problems)}; llaunch computes default, "
            f"{', '.join(rope.ROPE_TYPES)} rotary tables (transformers' rope_type names): serve another "
            "checkpoint, or fix model.rope_scaling (null: plain RoPE)")


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
    elif not os.path.exists(m.path) and not is_url(m.path):  # a URL: rules_checkpoint.checkpoint_path_local
        yield ("model.path",), f"model.path={m.path} does not exist: {missing_hint(m.path, 'checkpoint')}"


def missing_hint(path: str, what: str) -> str:
    """What to do about a checkpoint or tokenizer path that does not exist: the bundled models' folder
    is filled by scripts/prepare_models.py; any other path is the user's to fix."""
    if os.path.abspath(path).startswith(os.path.join(store.models_dir(), "")):
        return (f"it is under the bundled models' folder {store.models_dir()}: run scripts/prepare_models.py "
                "(make setup), or set LLAUNCH_MODELS_DIR to where they are")
    if what == "tokenizer":
        return "give a folder with tokenizer.json / tokenizer_config.json, or leave model.tokenizer unset (model.path's)"
    return ("give a Hugging Face checkpoint folder (config.json, *.safetensors), a .gguf file, or a Hub id "
            "(org/name, from the Hugging Face cache); relative paths are from the current directory")


@rule(live="warn")
def tokenizer_exists(cfg):
    t = cfg.model.tokenizer  # unset: the checkpoint's folder, or none at all for bare dummy weights
    if cfg.mode.kind != Mode.config_server and t is not None and not os.path.exists(t) and not is_url(t) \
            and t != cfg.model.path:  # model.path's own: weights_need_path says it once
        yield ("model.tokenizer",), f"model.tokenizer={t} does not exist: {missing_hint(t, 'tokenizer')}"


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
    if ckpt is not None and ckpt.unsupported and cfg.model.family in FAMILIES:  # else family_supported says it
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
    if rope.rope_problems(m.rope_scaling, rotary_dim(m)):
        return  # rope_scaling_supported says why
    longest = rope.context_length(m.max_position_embeddings, m.rope_scaling, m.family)
    if not 1 <= m.max_model_len <= longest:
        scaled = f" stretched by model.rope_scaling ({rope.rope_type(m.rope_scaling)})" \
            if longest != m.max_position_embeddings else ""
        yield ("model.max_model_len", "model.max_position_embeddings"), (
            f"model.max_model_len={m.max_model_len} is outside 1..{longest} (model.max_position_embeddings="
            f"{m.max_position_embeddings}{scaled}): the model was not trained for longer contexts; lower "
            f"model.max_model_len or leave it unset")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@rule()
def model_variants_served(cfg):
    """The decoder variants the model code runs (runtime/models/decoder_variants.py): windows, layer types,
    activations, soft-caps, Gemma's attention scale and local rotary base, Phi-3's partial rotary."""
    m = cfg.model
    if m.hidden_act is not None and m.hidden_act not in ACTIVATIONS:
        yield ("model.hidden_act",), (f"model.hidden_act={m.hidden_act!r} is not served: llaunch's MLPs compute "
                                      f"{' and '.join(ACTIVATIONS)} (null: silu)")
    if m.layer_types is not None and (any(t not in LAYER_TYPES for t in m.layer_types) or (
            m.num_hidden_layers is not None and len(m.layer_types) != m.num_hidden_layers)):
        yield ("model.layer_types", "model.num_hidden_layers"), (
            f"model.layer_types needs one of {', '.join(LAYER_TYPES)} for each of the model.num_hidden_layers="
            f"{m.num_hidden_layers} layers, got {list(m.layer_types)}; null: every layer windowed when "
            "model.sliding_window is set (Gemma: its family's pattern)")
    for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "rope_local_base_freq"):
        value = getattr(m, key)
        if value is not None and not _positive(value):
            yield (f"model.{key}",), f"model.{key}={value!r} must be a positive number, or null (none)"
    partial = m.partial_rotary_factor
    if partial is not None and partial != 1.0:
        if m.family != "phi3":
            yield ("model.partial_rotary_factor", "model.family"), (
                f"model.partial_rotary_factor={partial} with model.family={m.family!r}: rotary on part of each "
                "head is the phi3 family's (transformers applies it there only); set it to null")
        elif not (_positive(partial) and partial < 1 and m.head_dim and rotary_dim(m) % 2 == 0 and rotary_dim(m) > 0):
            yield ("model.partial_rotary_factor",), (
                f"model.partial_rotary_factor={partial} must rotate an even number of a head's model.head_dim="
                f"{m.head_dim} dims (0 < factor <= 1)")
