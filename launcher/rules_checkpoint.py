"""Rules over what a checkpoint path holds, so that a checkpoint the worker cannot serve is refused
before any process starts: a URL (s3://, hf://, https://) is not fetched, and a causal LM checkpoint
without an LM head whose config.json does not tie it to the embeddings would generate from a guess.
(A path that does not exist: rules_model.weights_need_path.)"""
from __future__ import annotations

import os

from llaunch.launcher.derive import is_url
from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import LoadFormat, ModelTask, ScoreHead, SpecMethod
from llaunch.runtime.models.checkpoint import (CheckpointError, is_gguf, model_tensor_name, read_checkpoint,
                                               safetensors_names)

HUB_KEYS = ("model.path", "spec.draft_model_path")  # a Hub id there is found in the cache (launcher/derive.py)


@rule()
def checkpoint_path_local(cfg):
    m = cfg.model
    paths = {"model.path": m.path if serves(cfg) else None, "model.tokenizer": m.tokenizer if serves(cfg) else None,
             "spec.draft_model_path": cfg.spec.draft_model_path if cfg.spec.method == SpecMethod.draft else None}
    for key, path in paths.items():
        if not is_url(path) or (key == "model.tokenizer" and path == m.path):  # model.path's: said once
            continue
        scheme, rest = path.split("://", 1)
        if scheme.lower() == "hf" and key in HUB_KEYS:
            fix = f"give the Hub id itself, {key}={rest} (taken from the Hugging Face cache, or downloaded at start)"
        else:
            fix = "copy it to this host and give its local path"
        yield (key,), f"{key}={path}: llaunch does not fetch {scheme}:// URLs; {fix}"


@rule()
def checkpoint_has_lm_head(cfg):
    """transformers would initialise such a head at random (and warn); the loader cannot know the real one."""
    m = cfg.model
    lm_head = m.task == ModelTask.generate or (m.task == ModelTask.score and m.score_head == ScoreHead.yes_no)
    if (not serves(cfg) or not lm_head or m.tie_word_embeddings or m.load_format != LoadFormat.safetensors
            or not m.path or is_gguf(m.path) or not os.path.isdir(m.path)):
        return
    try:
        names = safetensors_names(m.path)
    except CheckpointError as e:
        yield ("model.path",), f"model.path={m.path}: {e}"
        return
    if names is None or "lm_head.weight" in {model_tensor_name(n) for n in names}:
        return
    ckpt = read_checkpoint(m.path)
    base = [a for a in (ckpt.architectures if ckpt else []) if a.endswith("Model")]
    what = f" ({base[0]}: a base model saved without its head, as embedding models are)" if base else ""
    yield ("model.path", "model.tie_word_embeddings"), (
        f"model.path={m.path} has no LM head{what}: none of its {len(names)} tensors is lm_head.weight in any layout "
        "transformers writes, and model.tie_word_embeddings=false (its config.json) says the output layer is not "
        "the embedding either, so the text would come from a made-up head; serve the checkpoint with its head "
        "(*ForCausalLM), a score model (*ForSequenceClassification, model.task=score), or an embedding model's "
        "base as one (model.task=embed)")
