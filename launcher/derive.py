"""Derived values, computed once in the launcher: the model's architecture, dtype and eos ids from the
checkpoint (config.json or GGUF metadata) where the profile leaves them unset, the concrete device,
the load format, the context length and the router's batch_max_tokens.

torch is imported only when a GPU device node exists: start-up on a CPU machine stays fast.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Optional

from llaunch.launcher.schema import (
    Device, DType, LlaunchConfig, LoadFormat, Mode, ModelConfig, RouterConfig,
)

ARCH_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
    "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
)
# Spellings of config.json's dtype (and LightLLM's --data_type) that we can run.
DTYPE_NAMES = {
    "float16": DType.float16, "fp16": DType.float16, "half": DType.float16,
    "bfloat16": DType.bfloat16, "bf16": DType.bfloat16,
    "float32": DType.float32, "fp32": DType.float32, "float": DType.float32,
}
# Every Qwen2 and Llama-3 checkpoint ships bf16; used on GPU when there is no checkpoint to ask.
GPU_FALLBACK_DTYPE = DType.bfloat16
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


class CheckpointError(ValueError):
    """model.path exists but cannot be read as a checkpoint."""


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint says about itself, in ModelConfig's field names."""

    family: Optional[str]  # config.json model_type / GGUF general.architecture
    arch: dict[str, Any] = field(default_factory=dict)
    dtype: Optional[str] = None  # as written (torch_dtype / dtype); None for GGUF
    eos_token_ids: list[int] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # features it uses that llaunch does not run


def is_gguf(path: Optional[str]) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _from_hf_config(folder: str) -> Checkpoint:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{folder} has no config.json (a Hugging Face checkpoint folder is expected)")
    c = _read_json(config_path)
    c = c.get("text_config", c)  # multimodal wrappers keep the language model's config inside
    family = c.get("model_type")
    rope_parameters = c.get("rope_parameters") or {}  # transformers 5 folds rope_theta/scaling in here
    rope_scaling = c.get("rope_scaling")
    if rope_scaling is None:
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None  # plain RoPE
    heads = c.get("num_attention_heads")
    arch = {
        "hidden_size": c.get("hidden_size"),
        "intermediate_size": c.get("intermediate_size"),
        "num_hidden_layers": c.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim"),
        "vocab_size": c.get("vocab_size"),
        "max_position_embeddings": c.get("max_position_embeddings"),
        "rope_theta": c.get("rope_theta", rope_parameters.get("rope_theta")),
        "rope_scaling": rope_scaling,
        "rms_norm_eps": c.get("rms_norm_eps"),
        "tie_word_embeddings": c.get("tie_word_embeddings", False),  # Llama/Qwen2 config default
        "attention_bias": True if family == "qwen2" else c.get("attention_bias", False),
    }
    eos = _eos_list(c.get("eos_token_id"))
    generation_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(generation_path):  # generate() stops at these too: take the union
        eos += [t for t in _eos_list(_read_json(generation_path).get("eos_token_id")) if t not in eos]
    dtype = c.get("torch_dtype", c.get("dtype"))
    unsupported = [f"{key}=true" for key in ("mlp_bias", "use_sliding_window") if c.get(key)]
    return Checkpoint(family=family, arch={k: v for k, v in arch.items() if v is not None},
                      dtype=str(dtype) if dtype is not None else None, eos_token_ids=eos, unsupported=unsupported)


def _float32(value: float) -> float:
    return float(f"{value:.7g}")  # GGUF stores float32: 1e-5 reads back as 9.9999997e-06


def _from_gguf(path: str) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/OSError on bad files
        raise CheckpointError(f"cannot read GGUF {path}: {e}") from e
    meta = {name: f.contents() for name, f in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_token_id")}
    family = meta.get("general.architecture")
    tensors = {t.name for t in reader.tensors}

    def key(suffix: str):
        return meta.get(f"{family}.{suffix}")

    vocab = key("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = key("rope.scaling.type")
    arch = {
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv") or key("attention.head_count"),
        "head_dim": key("attention.key_length"),
        "vocab_size": vocab,
        "max_position_embeddings": key("context_length"),
        "rope_theta": _float32(key("rope.freq_base")) if key("rope.freq_base") else None,
        "rope_scaling": ({"rope_type": scaling_type, "factor": key("rope.scaling.factor")}
                         if scaling_type not in (None, "none") else None),
        "rms_norm_eps": (_float32(key("attention.layer_norm_rms_epsilon"))
                         if key("attention.layer_norm_rms_epsilon") else None),
        "tie_word_embeddings": "output.weight" not in tensors,  # no LM head: it reuses the embedding
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    return Checkpoint(family=family, arch={k: v for k, v in arch.items() if v is not None},
                      eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")))


@lru_cache(maxsize=8)
def read_checkpoint(path: str) -> Optional[Checkpoint]:
    """The checkpoint at `path` (a folder with config.json, or a .gguf file); None if it does not exist."""
    if not os.path.exists(path):
        return None
    return _from_gguf(path) if is_gguf(path) else _from_hf_config(path)


def detect_device() -> Device:
    if not any(os.path.exists(p) for p in _GPU_DEVICE_NODES):
        return Device.cpu
    import torch

    return Device.cuda if torch.cuda.is_available() else Device.cpu


def checkpoint_dtype(ckpt: Optional[Checkpoint]) -> Optional[DType]:
    if ckpt is None or ckpt.dtype is None:
        return None
    return DTYPE_NAMES.get(ckpt.dtype.removeprefix("torch."))


def _absolute(path: Optional[str]) -> Optional[str]:
    return os.path.abspath(os.path.expanduser(path)) if path else path


def resolve_model(model: ModelConfig, device: Device) -> ModelConfig:
    path = _absolute(model.path)
    ckpt = read_checkpoint(path) if path else None
    filled = {f: ckpt.arch[f] for f in ARCH_FIELDS
              if ckpt is not None and getattr(model, f) is None and f in ckpt.arch}
    arch = {f: getattr(model, f) for f in ARCH_FIELDS} | filled
    family = model.family or (ckpt.family if ckpt else None)
    if arch["head_dim"] is None and arch["hidden_size"] and arch["num_attention_heads"]:
        arch["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    if family in ("llama", "qwen2"):
        if arch["tie_word_embeddings"] is None:
            arch["tie_word_embeddings"] = False
        if arch["attention_bias"] is None:
            arch["attention_bias"] = family == "qwen2"
    load_format = model.load_format
    if load_format == LoadFormat.auto and path:
        load_format = LoadFormat.gguf if is_gguf(path) else LoadFormat.safetensors
    dtype = model.dtype
    if dtype == DType.auto:
        if device == Device.cpu:
            dtype = DType.float32
        elif ckpt is None or ckpt.dtype is None:
            dtype = GPU_FALLBACK_DTYPE
        else:  # an unsupported checkpoint dtype stays auto: rules.checkpoint_dtype_supported says so
            dtype = checkpoint_dtype(ckpt) or DType.auto
    eos = model.eos_token_ids or (ckpt.eos_token_ids if ckpt and ckpt.eos_token_ids else None)
    return replace(
        model, **arch, family=family, path=path, tokenizer=_absolute(model.tokenizer) or path,
        load_format=load_format, dtype=dtype, eos_token_ids=eos,
        max_model_len=model.max_model_len or arch["max_position_embeddings"],
    )


def resolve_router(router: RouterConfig, model: ModelConfig, mode: Mode) -> RouterConfig:
    """LightLLM's batch_max_tokens defaults (api_start.py): without chunked prefill a whole request
    must fit one step; with it, two chunks, but no more than a request's length and no less than a chunk."""
    batch_max_tokens = router.batch_max_tokens
    if batch_max_tokens is None:
        if not router.chunked_prefill:
            batch_max_tokens = model.max_model_len
        elif model.max_model_len is None:
            batch_max_tokens = 2 * router.chunked_prefill_size
        else:
            batch_max_tokens = max(router.chunked_prefill_size,
                                   min(model.max_model_len, 2 * router.chunked_prefill_size))
    # A decode node gets its prompts prefilled elsewhere: nothing to wait for (LightLLM: decode mode).
    max_wait_tokens = 0 if mode == Mode.pd_decode else router.max_wait_tokens
    return replace(router, batch_max_tokens=batch_max_tokens, max_wait_tokens=max_wait_tokens)


def resolve(cfg: LlaunchConfig) -> LlaunchConfig:
    """Fill every derived value; a field the profile or the command line set is kept."""
    device = detect_device() if cfg.device == Device.auto else cfg.device
    model = resolve_model(cfg.model, device)
    return replace(cfg, device=device, model=model, router=resolve_router(cfg.router, model, cfg.mode.kind))
