"""The start-up rules of speculative decoding (the spec group): its settings' ranges, the proposers
that exist, and the instances where rows can speculate at all."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from llaunch.launcher.derive import is_url
from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Mode, ModelTask, SpecMethod
from llaunch.runtime.models.checkpoint import CheckpointError, read_checkpoint

DRAFT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # text-only causal LMs (runtime/models/decoder.py)

MAX_SPEC_TOKENS = 16  # proposals per row and step; beyond, a verify step costs more than a miss saves


def _on(cfg) -> bool:
    return cfg.spec.method != SpecMethod.none


@rule()
def spec_settings_valid(cfg):
    s = cfg.spec
    if not _on(cfg):
        return
    if not 1 <= s.num_tokens <= MAX_SPEC_TOKENS:
        yield ("spec.num_tokens",), f"spec.num_tokens={s.num_tokens}: give 1..{MAX_SPEC_TOKENS} proposed tokens"
    if not 1 <= s.ngram_min <= s.ngram_max:
        yield ("spec.ngram_min", "spec.ngram_max"), (
            f"spec.ngram_min={s.ngram_min}, spec.ngram_max={s.ngram_max}: need 1 <= ngram_min <= ngram_max")
    if s.max_batch < 1:
        yield ("spec.max_batch",), (f"spec.max_batch={s.max_batch}: give the largest decode batch that speculates "
                                    "(>= 1), or spec=none to turn speculation off")


@rule()
def spec_draft_model_usable(cfg):
    """spec.method=draft: a causal LM of a served family, with the model's tokenizer, whose KV can
    follow the model's everywhere it goes (runtime/worker/drafter.py)."""
    s = cfg.spec
    if s.method != SpecMethod.draft:
        return
    keys = ("spec.method", "spec.draft_model_path")
    if not s.draft_model_path:
        yield keys, ("spec.method=draft needs spec.draft_model_path: a checkpoint folder with the model's tokenizer "
                     "(a smaller model of its family); or use spec=ngram")
    else:
        yield from (((keys, p) for p in draft_checkpoint_problems(s.draft_model_path, cfg.model)))
    m = cfg.model
    if m.vision or m.audio:
        yield ("spec.method", "model.path"), (
            f"spec.method=draft with the multimodal model {m.name or m.path}: the draft model cannot read images or "
            "audio; use spec=ngram")
    if cfg.cache.cpu_tokens > 0:
        yield ("spec.method", "cache.cpu_tokens"), (
            f"spec.method=draft with cache.cpu_tokens={cfg.cache.cpu_tokens}: the host KV tier keeps the model's KV, "
            "not the draft's; use cache.cpu_tokens=0 or spec=ngram")


def draft_checkpoint_problems(path: str, model) -> list[str]:
    """Why the checkpoint at `path` cannot draft for `model` ([] if it can)."""
    if is_url(path):
        return []  # rules_checkpoint.checkpoint_path_local refuses it
    try:
        ckpt = read_checkpoint(path)
    except CheckpointError as e:
        return [f"spec.draft_model_path={path}: {e}"]
    if ckpt is None:
        return [f"spec.draft_model_path={path} does not exist"]
    if ckpt.family not in DRAFT_FAMILIES or ckpt.score_head:
        return [f"spec.draft_model_path={path} is a {ckpt.score_head or ckpt.family} checkpoint; a draft is a causal "
                f"LM of the {' or '.join(DRAFT_FAMILIES)} family"]
    if ckpt.unsupported:
        return [f"spec.draft_model_path={path} uses {', '.join(ckpt.unsupported)}, which llaunch does not run"]
    if ckpt.weight_quant is not None:
        return [f"spec.draft_model_path={path} is {ckpt.weight_quant.method}-quantized; give a float draft checkpoint"]
    mismatch = tokenizer_mismatch(model.tokenizer or model.path, path)
    return [f"spec.draft_model_path={path}: {mismatch}; a draft must share the model's tokenizer"] if mismatch else []


def _vocab(folder) -> Optional[tuple]:
    """tokenizer.json's vocabulary and added tokens, or None without one."""
    f = Path(folder) / "tokenizer.json" if folder else None
    if f is None or not f.is_file():
        return None
    tok = json.loads(f.read_text())
    return (tok.get("model", {}).get("vocab"), sorted((t["id"], t["content"]) for t in tok.get("added_tokens", [])))


def tokenizer_mismatch(model_folder, draft_folder) -> Optional[str]:
    mine, theirs = _vocab(model_folder), _vocab(draft_folder)
    if theirs is None:
        return f"{draft_folder} has no tokenizer.json to compare with the model's"
    if mine is None:
        return f"the model's tokenizer ({model_folder}) has no tokenizer.json to compare with the draft's"
    return None if mine == theirs else "its tokenizer.json has another vocabulary than the model's"


@rule()
def spec_where_rows_decode(cfg):
    if not _on(cfg):
        return
    kind = cfg.mode.kind
    if kind in (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master):
        yield ("spec.method", "mode.kind"), (
            f"spec.method={cfg.spec.method.value} with mode.kind={kind.value}: speculative decoding runs on "
            "mode.kind=normal instances only (a prefill instance samples one token; a decode instance's "
            "received KV is not verified against it yet); use spec=none")
    if cfg.model.task in (ModelTask.score, ModelTask.embed):
        yield ("spec.method", "model.task"), (
            f"spec.method with model.task={cfg.model.task.value}: a score or embedding model generates no tokens to "
            "speculate on; use spec=none")
    if cfg.server.return_all_prompt_logprobs:
        yield ("spec.method", "server.return_all_prompt_logprobs"), (
            f"spec.method={cfg.spec.method.value} with server.return_all_prompt_logprobs=true: every request then "
            "computes its prompt's logprobs, and such rows decode one token a step, so speculation would never run; "
            "use spec=none, or turn that off")
