"""`build_model`: this rank's shard of a model, with its weights loaded (what the worker's runner runs)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.weights import load_weights


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                process_group=None, progress: Optional[Callable[[float], None]] = None) -> DecoderLM:
    """This rank's shard of the model `cfg` describes (architecture fields resolved), weights loaded
    per cfg.load_format. With tp_size > 1, torch.distributed must be initialised (process_group
    None: the default group). `progress` gets the share of the weights loaded, as they load."""
    arch = ModelArch.from_model_config(cfg)
    max_positions = max(arch.max_position_embeddings, cfg.max_model_len or 0)
    model = DecoderLM(arch, TpGroup(tp_rank, tp_size, process_group), torch.device(device), dtype, max_positions)
    load_weights(model, cfg, progress)
    return model.eval()
