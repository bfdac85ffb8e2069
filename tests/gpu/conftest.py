"""GPU checks with thresholds (the `gpu` marker): they run on a CUDA machine with TRITON_INTERPRET=0
(`scripts/gpu_run.sh` runs them first in every GPU call) and skip elsewhere. A missed threshold
fails the test, and with it the GPU run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if not GPU:
                item.add_marker(pytest.mark.skipif(True, reason="needs a CUDA GPU and TRITON_INTERPRET=0"))


def profile_shape(name: str) -> dict:
    """A sized model profile's architecture (conf/model/NAME.yaml) as config.json keys."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    profile = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    return {k: profile[k] for k in keys} | {"model_type": profile["family"]}
