"""The start-up rules of speculative decoding (the spec group): its settings' ranges, the proposers
that exist, and the instances where rows can speculate at all."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Mode, ModelTask, SpecMethod

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
def spec_method_available(cfg):
    if cfg.spec.method == SpecMethod.draft:
        yield ("spec.method",), ("spec.method=draft: the draft-model proposer is not built yet (README, speculative "
                                 "decoding); use spec=ngram, or spec=none")


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
    if cfg.model.task == ModelTask.score:
        yield ("spec.method", "model.task"), (
            "spec.method with model.task=score: a score model generates no tokens to speculate on; use spec=none")
    if cfg.server.return_all_prompt_logprobs:
        yield ("spec.method", "server.return_all_prompt_logprobs"), (
            f"spec.method={cfg.spec.method.value} with server.return_all_prompt_logprobs=true: every request then "
            "computes its prompt's logprobs, and such rows decode one token a step, so speculation would never run; "
            "use spec=none, or turn that off")
