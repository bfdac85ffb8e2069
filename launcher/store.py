"""Hydra wiring: where the profiles live, the `models_dir` resolver, and the schemas every YAML names.

Each profile's defaults list starts with `/<group>_schema@_here_`, so its keys and types are checked
against the dataclass of runtime/config.py when it is composed.
"""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import llaunch.launcher
from llaunch.runtime import config as schema

# A checkout's root; in an installed wheel site-packages/llaunch, where conf/ is package data (pyproject.toml)
REPO_ROOT = Path(llaunch.launcher.__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
GROUPS = ("model", "parallel", "cache", "mode", "router", "server", "kernels", "visual", "audio", "spec", "bench")

_SCHEMAS = {
    "llaunch_schema": schema.LlaunchConfig,
    "model_schema": schema.ModelConfig,
    "parallel_schema": schema.ParallelConfig,
    "cache_schema": schema.CacheConfig,
    "mode_schema": schema.ModeConfig,
    "router_schema": schema.RouterConfig,
    "server_schema": schema.ServerConfig,
    "kernels_schema": schema.KernelSettings,
    "visual_schema": schema.VisualConfig,
    "audio_schema": schema.AudioConfig,
    "spec_schema": schema.SpecConfig,
    "bench_schema": schema.BenchConfig,
}


def models_dir() -> str:
    """Where checkpoints live: $LLAUNCH_MODELS_DIR, else <repo>/.models (scripts/prepare_models.py)."""
    return os.environ.get("LLAUNCH_MODELS_DIR") or str(REPO_ROOT / ".models")


def _writable(node):
    """OmegaConf marks frozen dataclasses read-only, which would refuse every profile merged on top."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing() \
            and OmegaConf.get_type(node) is dict:
        node._set_flag("struct", False)  # a Dict[str, X] field takes any key (model.sampling_defaults)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        for key in node.keys():
            _writable(node._get_node(key))
    return node


def schema_node(cls) -> DictConfig:
    return _writable(OmegaConf.structured(cls))


def register() -> None:
    """Register the resolver and the schemas (idempotent); call before composing."""
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("models_dir", models_dir, replace=True)
    store = ConfigStore.instance()
    for name, cls in _SCHEMAS.items():
        store.store(name=name, node=schema_node(cls))


def profiles(group: str) -> list[str]:
    """The options of a config group, from conf/<group>/*.yaml."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
