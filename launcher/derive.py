"""Derived values, computed once in the launcher: the model's architecture, dtype and eos ids from the
checkpoint (runtime/models/checkpoint.py) where the profile leaves them unset, the concrete device,
the load format, the context length and the router's batch_max_tokens.

No torch here: the device is found from the driver (launcher/gpus.py), so planning stays fast.
"""
from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from llaunch.launcher import gpus
from llaunch.runtime.config import (Device, DType, LlaunchConfig, LoadFormat, Mode, ModelConfig, ModelTask, Pooling,
                                    ScoreHead, RouterConfig, SpecMethod)
from llaunch.runtime.models import rope
from llaunch.runtime.models.arch import FAMILIES, QKV_ONLY_BIAS_FAMILIES
from llaunch.runtime.models.pooling_config import EmbeddingFacts, embedding_facts
from llaunch.runtime.models.tokenizer import vocab_ids
from llaunch.runtime.models.moe_config import MOE_FAMILIES
from llaunch.runtime.models.decoder_variants import GEMMA_FAMILIES
from llaunch.runtime.models.checkpoint import (ARCH_FIELDS, Checkpoint, CheckpointError, checkpoint_dtype, is_gguf,
                                               read_checkpoint)

__all__ = ["CheckpointError", "resolve", "resolve_draft", "resolve_model", "resolve_router", "detect_device"]

# Every Qwen2 and Llama-3 checkpoint ships bf16; used on GPU when there is no checkpoint to ask.
GPU_FALLBACK_DTYPE = DType.bfloat16


def detect_device() -> Device:
    return Device.cuda if gpus.visible_count() > 0 else Device.cpu


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, hf://, https://: never fetched (rules_checkpoint.py)


def is_url(path: str | None) -> bool:
    return bool(path) and bool(_URL.match(path))


def _absolute(path: str | None) -> str | None:
    """A local path made absolute; a URL stays as given, for the rule that refuses it to name."""
    return os.path.abspath(os.path.expanduser(path)) if path and not is_url(path) else path


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def hub_snapshot(repo_id: str, key: str = "model.path") -> str:
    """A Hugging Face Hub id as a local folder: the cache's snapshot, else downloaded (with progress)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise CheckpointError(f"{key}={repo_id} is neither a local path nor in the Hugging Face cache, and "
                              f"downloading it failed: {str(e).splitlines()[0]}") from None


def _hub_id(path: str | None) -> str | None:
    return path if path and not os.path.exists(path) and _HUB_ID.fullmatch(path) else None


def local_path(path: str | None, key: str) -> str | None:
    """A checkpoint path as a local folder: a Hub id through the cache (or a download), else absolute."""
    return hub_snapshot(path, key) if _hub_id(path) else _absolute(path)


def resolve_model(model: ModelConfig, device: Device) -> ModelConfig:
    hub_id = _hub_id(model.path)
    path = local_path(model.path, "model.path")
    ckpt = read_checkpoint(path) if path else None
    filled = {f: ckpt.arch[f] for f in ARCH_FIELDS
              if ckpt is not None and getattr(model, f) is None and f in ckpt.arch}
    arch = {f: getattr(model, f) for f in ARCH_FIELDS} | filled
    family = model.family or (ckpt.family if ckpt else None)
    if arch["head_dim"] is None and arch["hidden_size"] and arch["num_attention_heads"]:
        arch["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    if family in ("llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA_FAMILIES, *MOE_FAMILIES):
        if arch["tie_word_embeddings"] is None:
            arch["tie_word_embeddings"] = family in GEMMA_FAMILIES  # Gemma's always tie
        if arch["attention_bias"] is None:
            arch["attention_bias"] = family in QKV_ONLY_BIAS_FAMILIES
    load_format = model.load_format
    if load_format == LoadFormat.auto and path:
        load_format = LoadFormat.gguf if is_gguf(path) else LoadFormat.safetensors
    dtype = model.dtype
    if dtype == DType.auto:
        if device == Device.cpu:
            dtype = DType.float32
        elif ckpt is None or ckpt.dtype is None:
            dtype = GPU_FALLBACK_DTYPE
        else:  # an unsupported checkpoint dtype stays auto: rules_model.checkpoint_dtype_supported says so
            dtype = checkpoint_dtype(ckpt) or DType.auto
            if dtype == DType.float32:  # as vLLM's auto: a float32 checkpoint is served in 16 bits (float32: ask)
                dtype = GPU_FALLBACK_DTYPE
    eos = model.eos_token_ids or (ckpt.eos_token_ids if ckpt and ckpt.eos_token_ids else None)
    return replace(
        model, **(arch | task_fields(model, ckpt, arch["num_labels"], path)), name=model.name or hub_id or served_name(path) or family, family=family, path=path, tokenizer=_absolute(model.tokenizer) or path,
        load_format=load_format, dtype=dtype, eos_token_ids=eos,
        sampling_defaults={**(ckpt.sampling if ckpt and model.generation_config else {}), **model.sampling_defaults},
        max_model_len=model.max_model_len or default_context(arch, family),
    )


def default_context(arch: dict, family: str | None = None) -> int | None:
    """The context a checkpoint is served at unless model.max_model_len says otherwise: its trained
    length, stretched by its rope scaling (YaRN, linear, dynamic). A sliding window does not cap it: the
    attention kernels honour each layer's window."""
    if arch["max_position_embeddings"] is None:
        return None
    longest = arch["max_position_embeddings"]
    if not rope.rope_problems(arch["rope_scaling"], rope.rotary_dim(arch["head_dim"], arch["partial_rotary_factor"])):
        longest = rope.context_length(longest, arch["rope_scaling"], family)
    return longest


YES_NO_TOKENS = ["yes", "no"]  # Qwen3-Reranker's answer tokens (convert_tokens_to_ids of these)


def task_fields(model: ModelConfig, ckpt: Checkpoint | None, num_labels: int | None, path: str | None) -> dict:
    """model.task (auto: score when config.json names a classification/reward head, a dummy profile sets
    num_labels, or model.score_head=yes_no; embed for a sentence-transformers folder (modules.json) of a served
    decoder family; else generate) and what the task reads: a score model's labels, pad token and head (a yes/no
    head's token ids), an embedding model's pooling."""
    facts = embedding_facts(path) if path and not is_gguf(path) else None
    task = model.task
    if task == ModelTask.auto:
        if (ckpt is not None and ckpt.score_head) or (ckpt is None and num_labels) or model.score_head == ScoreHead.yes_no:
            task = ModelTask.score
        elif facts is not None and facts.sentence_transformers and ckpt is not None and ckpt.family in FAMILIES:
            task = ModelTask.embed
        else:
            task = ModelTask.generate
    if task == ModelTask.embed:
        return {"task": task, **embed_fields(model, facts)}
    if task != ModelTask.score:
        return {"task": task}
    head = model.score_head or (ScoreHead.mlp if ckpt is not None and ckpt.score_mlp else ScoreHead.linear)
    fields = {"task": task, "score_head": head}
    if head == ScoreHead.yes_no:  # one output; transformers' pad stripping is a classification head's, not this
        num_labels = fields["num_labels"] = 1
        ids = model.score_token_ids
        tokenizer = _absolute(model.tokenizer) or path
        if ids is None and tokenizer and os.path.isdir(tokenizer):
            found = vocab_ids(tokenizer, YES_NO_TOKENS)
            ids = found if found is not None and None not in found else None  # else rules_score says what to set
        fields["score_token_ids"] = ids
    labels = model.labels or (ckpt.labels if ckpt and ckpt.labels else None)
    if labels is None and num_labels:
        labels = [f"LABEL_{i}" for i in range(num_labels)]  # transformers' default id2label
    pad = model.pad_token_id if model.pad_token_id is not None else (ckpt.pad_token_id if ckpt else None)
    return fields | {"labels": labels, "pad_token_id": None if head == ScoreHead.yes_no else pad}


def embed_fields(model: ModelConfig, facts: EmbeddingFacts | None) -> dict:
    """An embedding model's pooling (the Pooling module's; last without one; None when the folder asks for one
    llaunch does not compute: rules_score.embed_pooling_served says so), normalization (a Normalize module; without modules.json:
    normalized, as vLLM) and Matryoshka sizes (config.json's)."""
    sentence = facts is not None and facts.sentence_transformers
    pooling = model.pooling or (facts.pooling if sentence else Pooling.last)
    if pooling is None and not facts.unserved_pooling:
        pooling = Pooling.last  # a sentence-transformers folder without a Pooling module
    normalize = model.normalize if model.normalize is not None else (facts.normalize if sentence else True)
    matryoshka = model.matryoshka
    if matryoshka is None:
        matryoshka = bool(model.matryoshka_dimensions) or (facts is not None and facts.matryoshka)
    dims = model.matryoshka_dimensions or (facts.matryoshka_dimensions if facts is not None else None)
    return {"pooling": pooling, "normalize": normalize, "matryoshka": matryoshka, "matryoshka_dimensions": dims}


def served_name(path: str | None) -> str | None:
    """The name a checkpoint is served under by default: its folder's name, or its .gguf file's stem."""
    if not path:
        return None
    p = Path(path.rstrip("/"))
    return p.stem if is_gguf(path) else p.name


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


def resolve_draft(cfg: LlaunchConfig) -> ModelConfig | None:
    """spec.method=draft: the draft checkpoint's config, in the model's dtype and context length (the
    draft computes every position the model does)."""
    if cfg.spec.method != SpecMethod.draft or not cfg.spec.draft_model_path:
        return None
    draft = ModelConfig(path=cfg.spec.draft_model_path, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len)
    return resolve_model(draft, cfg.device)


def resolve(cfg: LlaunchConfig) -> LlaunchConfig:
    """Fill every derived value; a field the profile or the command line set is kept."""
    device = detect_device() if cfg.device == Device.auto else cfg.device
    model = resolve_model(cfg.model, device)
    spec = cfg.spec
    if spec.method == SpecMethod.draft and spec.draft_model_path:  # the rules and the workers read one folder
        spec = replace(spec, draft_model_path=local_path(spec.draft_model_path, "spec.draft_model_path"))
    # frontends read the template and workers write profiles, wherever they run
    server = replace(cfg.server, chat_template=_absolute(cfg.server.chat_template),
                     profile_dir=_absolute(cfg.server.profile_dir))
    return replace(cfg, device=device, model=model, router=resolve_router(cfg.router, model, cfg.mode.kind), spec=spec,
                   server=server)
