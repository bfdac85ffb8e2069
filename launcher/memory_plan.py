"""Memory in the plan: what one rank holds (runtime/models/memory.py's estimate: weights, a step's
activations, KV per token), printed by a dry run, and the rule that refuses a model whose weights do
not fit this machine before anything starts (on a GPU: within cache.mem_fraction of the smallest
GPU; on CPU: with the KV budget, within the host's memory)."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from llaunch.launcher import derive, gpus
from llaunch.launcher.rule_registry import get, rule
from llaunch.launcher.rules_model import SERVING_MODES
from llaunch.runtime.config import Device, KvDType, LlaunchConfig
from llaunch.runtime.encoder_servers import encoder_servers, multimodal
from llaunch.runtime.models.memory import GiB, RankMemory, rank_memory

_ARCH = ("model.family", "model.hidden_size", "model.intermediate_size", "model.num_hidden_layers",
         "model.num_attention_heads", "model.vocab_size", "model.max_position_embeddings", "router.batch_max_tokens")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def kv_budget_bytes(cfg: LlaunchConfig, mem: RankMemory, device_bytes: Optional[int]) -> Optional[int]:
    """What the KV cache gets: cache.max_total_tokens, the CPU budget, or the GPU's memory left."""
    if cfg.cache.max_total_tokens:
        return cfg.cache.max_total_tokens * mem.kv_per_token
    if cfg.device == Device.cpu:
        return int(cfg.cache.cpu_kv_gib * GiB)
    if device_bytes is None:
        return None
    return int(device_bytes * cfg.cache.mem_fraction) - mem.before_kv


def _rank_memory(cfg: LlaunchConfig) -> Optional[RankMemory]:
    """The estimate, or None when the model is not known well enough (other rules say why)."""
    if cfg.mode.kind not in SERVING_MODES or any(get(cfg, k) is None for k in _ARCH):
        return None
    try:
        mem = rank_memory(cfg)
        draft = derive.resolve_draft(cfg)
    except (ValueError, KeyError):  # an unsupported family or dtype: family_supported & co. report it
        return None
    if draft is None:
        return mem
    # spec.method=draft: every rank holds the whole draft and its KV for each slot (runtime/worker/drafter.py)
    try:
        d = rank_memory(replace(cfg, model=draft, parallel=replace(cfg.parallel, tp=1),
                                cache=replace(cfg.cache, kv_dtype=KvDType.auto)))
    except (ValueError, KeyError):  # spec_draft_model_usable says why
        return mem
    return replace(mem, weights=mem.weights + d.weights, kv_per_token=mem.kv_per_token + d.kv_per_token,
                   weights_dtype=f"{mem.weights_dtype}, with the draft model's")


def summary(cfg: LlaunchConfig) -> Optional[str]:
    """One line for the dry run, or None when the architecture is not known yet."""
    mem = _rank_memory(cfg)
    if mem is None:
        return None
    graphs = " and graph pools" if cfg.device != Device.cpu else ""
    experts = f", routed experts {_gib(mem.experts)}" if mem.experts else ""
    line = (f"memory per rank (estimate): weights {_gib(mem.weights)} ({mem.weights_dtype}{experts}), a step's "
            f"activations{graphs} {_gib(mem.activations)}, KV {mem.kv_per_token / 1024:.0f} KiB per token "
            f"({mem.kv_dtype})")
    device_bytes = gpus.memory_bytes() if cfg.device == Device.cuda else None
    budget = kv_budget_bytes(cfg, mem, device_bytes)
    if budget is None:
        return line + f"; a GPU needs {_gib(mem.before_kv)} within cache.mem_fraction before any KV" + _embed_caches(cfg)
    where = f" of {_gib(device_bytes)} per GPU" if device_bytes and not cfg.cache.max_total_tokens else ""
    line += f"; KV {_gib(max(budget, 0))}{where}: {max(budget, 0) // mem.kv_per_token:,} tokens"
    if cfg.cache.cpu_tokens > 0:  # the kv_host process's shared memory, one file per worker
        ranks = cfg.parallel.tp * cfg.parallel.dp // max(cfg.parallel.nnodes, 1)
        host = cfg.cache.cpu_tokens * mem.kv_per_token
        line += f"; host KV tier {_gib(host)} per rank ({cfg.cache.cpu_tokens:,} tokens), {_gib(host * ranks)} per node"
    return line + _embed_caches(cfg)


def _embed_caches(cfg) -> str:
    """The visual servers' embed caches (multimodal models): shared memory on node 0."""
    if not multimodal(cfg):
        return ""
    e = encoder_servers(cfg)
    return f"; embed cache {e.embed_cache_mib} MiB x {e.dp} {e.kind} server(s)"


@rule(needs=_ARCH, live="warn")
def weights_fit_memory(cfg):
    mem = _rank_memory(cfg)
    if mem is None:
        return
    if cfg.device == Device.cpu:  # every worker rank of this host holds its weights and its KV budget
        p = cfg.parallel
        ranks, host = max(1, p.tp * p.dp // max(p.nnodes, 1)), host_memory_bytes()
        kv_key = "cache.max_total_tokens" if cfg.cache.max_total_tokens else "cache.cpu_kv_gib"
        weights, kv = mem.weights * ranks, (kv_budget_bytes(cfg, mem, None) or 0) * ranks
        if weights + kv > host:
            yield ("model.dtype", kv_key), (
                f"weights ({_gib(weights)} with model.dtype={cfg.model.dtype.value}, {ranks} worker rank(s) here) "
                f"and KV ({_gib(kv)}, {kv_key}={get(cfg, kv_key)}) need more than this host's {_gib(host)}: "
                "take a smaller model, or a GPU")
        return
    device_bytes = gpus.memory_bytes()
    if device_bytes is None:
        return
    usable = device_bytes * cfg.cache.mem_fraction
    if mem.before_kv + cfg.model.max_model_len * mem.kv_per_token > usable:
        yield ("parallel.tp", "cache.mem_fraction", "model.max_model_len"), (
            f"each rank needs {_gib(mem.weights)} of weights + {_gib(mem.activations)} for a step + KV for one "
            f"request of model.max_model_len={cfg.model.max_model_len}, more than cache.mem_fraction="
            f"{cfg.cache.mem_fraction} of the {_gib(device_bytes)} GPU: raise parallel.tp, lower "
            f"router.batch_max_tokens or model.max_model_len, or take a smaller model")
