"""What a checkpoint folder says about serving it as an embedding model (model.task=embed): sentence-transformers'
modules.json (which modules follow the transformer: Pooling, Normalize, ...) and its Pooling module's config.json
(which pooling), and config.json's Matryoshka fields (vLLM's names: is_matryoshka, matryoshka_dimensions). One
reader for the launcher's derived values and rules; no torch."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from llaunch.runtime.config import Pooling

MODULES_FILE = "modules.json"
# 1_Pooling/config.json's switches that llaunch computes, and those it does not (each on alone; several on at once are
# concatenated by sentence-transformers: not served either)
POOLING_MODES = {"pooling_mode_lasttoken": Pooling.last, "pooling_mode_mean_tokens": Pooling.mean,
                 "pooling_mode_cls_token": Pooling.cls}
UNSERVED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
SERVED_MODULES = ("Transformer", "Pooling", "Normalize")  # sentence_transformers.models.<name>


@dataclass(frozen=True)
class EmbeddingFacts:
    sentence_transformers: bool  # the folder has a modules.json
    pooling: Optional[Pooling] = None  # its Pooling module's mode; None: no Pooling module (or one not served)
    normalize: bool = False  # modules.json has a Normalize module
    matryoshka: bool = False  # config.json: is_matryoshka, or matryoshka_dimensions given
    matryoshka_dimensions: Optional[list[int]] = None  # config.json's
    unserved_pooling: Optional[str] = None  # a Pooling module llaunch does not compute (max, weighted mean, ...)
    unserved_modules: tuple[str, ...] = ()  # modules after pooling that llaunch does not apply (Dense, LayerNorm)


def _json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _pooling(folder: str, module: dict) -> tuple[Optional[Pooling], Optional[str]]:
    """(the Pooling module's mode, None) or (None, what it asks for instead)."""
    path = os.path.join(folder, module.get("path") or "", "config.json")
    if not os.path.isfile(path):
        return None, f"a Pooling module without {os.path.relpath(path, folder)}"
    config = _json(path)
    on = [key for key in (*POOLING_MODES, *UNSERVED_MODES) if config.get(key)]
    if len(on) == 1 and on[0] in POOLING_MODES:
        return POOLING_MODES[on[0]], None
    if not on and isinstance(config.get("pooling_mode"), str):  # sentence-transformers 5's single field
        mode = {"lasttoken": Pooling.last, "mean": Pooling.mean, "cls": Pooling.cls}.get(config["pooling_mode"])
        return (mode, None) if mode is not None else (None, f"pooling_mode {config['pooling_mode']}")
    return None, f"pooling {' + '.join(k.removeprefix('pooling_mode_') for k in on) or 'of no mode'}"


@lru_cache(maxsize=8)
def embedding_facts(folder: Optional[str]) -> Optional[EmbeddingFacts]:
    """The folder's embedding facts; None when it is no folder (a .gguf file, dummy weights)."""
    if not folder or not os.path.isdir(folder):
        return None
    config_path = os.path.join(folder, "config.json")
    config = _json(config_path) if os.path.isfile(config_path) else {}
    dims = config.get("matryoshka_dimensions")
    dims = [int(d) for d in dims] if isinstance(dims, list) and dims else None
    matryoshka = bool(config.get("is_matryoshka")) or dims is not None
    modules_path = os.path.join(folder, MODULES_FILE)
    if not os.path.isfile(modules_path):
        return EmbeddingFacts(False, matryoshka=matryoshka, matryoshka_dimensions=dims)
    modules = _json(modules_path)
    pooling, unserved_pooling, normalize, unserved = None, None, False, []
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling, unserved_pooling = _pooling(folder, module)
        elif kind == "Normalize":
            normalize = True
        elif kind not in SERVED_MODULES:
            unserved.append(f"a {kind} module ({module.get('path') or module.get('name')})")
    return EmbeddingFacts(True, pooling, normalize, matryoshka, dims, unserved_pooling, tuple(unserved))
