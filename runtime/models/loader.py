"""`build_model`: this rank's shard of a model, with its weights loaded (what the worker's runner runs);
`build_vision_tower` and `build_audio_tower`: a multimodal model's towers (what an encoder server runs)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from llaunch.runtime.config import ModelConfig, WeightQuantization
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.audio_qwen2 import AudioArch, Qwen2AudioTower
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.fp8_linear import load_scales, quantize_linears, use_checkpoint_fp8
from llaunch.runtime.models.int8_linear import quantize_linears_int8
from llaunch.runtime.models.layers import ParallelLMHead, TpGroup
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower, VisionArch
from llaunch.runtime.models.vision_qwen2_5 import tower_class
from llaunch.runtime.models.weights import load_checkpoint_module, load_from, open_source, resolve_load_format


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                process_group=None, progress: Optional[Callable[[float], None]] = None,
                expert_parallel: bool = False) -> DecoderLM:
    """This rank's shard of the model `cfg` describes (architecture fields resolved), weights loaded
    per cfg.load_format. With tp_size > 1, torch.distributed must be initialised (process_group
    None: the default group). `progress` gets the share of the weights loaded, as they load.
    expert_parallel (parallel.ep = tp): an MoE model's ranks hold whole experts."""
    arch = ModelArch.from_model_config(cfg)
    max_positions = max(arch.max_position_embeddings, cfg.max_model_len or 0)
    model = DecoderLM(arch, TpGroup(tp_rank, tp_size, process_group), torch.device(device), dtype, max_positions,
                      expert_parallel)
    load_model_weights(model, cfg, progress)
    return model.eval()


def load_model_weights(model: DecoderLM, cfg: ModelConfig, progress: Optional[Callable[[float], None]] = None) -> None:
    """Weights per cfg.load_format; an fp8 checkpoint (quantization_config) fills fp8 layers with its
    scales, and model.quantization=fp8 (int8) quantizes a float checkpoint's linears after loading."""
    quant = None
    if cfg.path and resolve_load_format(cfg) == "safetensors":
        ckpt = read_checkpoint(cfg.path)
        quant = ckpt.weight_quant if ckpt is not None else None
    if quant is not None and not quant.served:  # the launcher refuses these first (checkpoint_quantization_supported)
        raise ValueError(f"{cfg.path}: {quant.method} quantization is not implemented ({'; '.join(quant.problems)})")
    source = open_source(cfg, model.device, model.arch.num_params)
    try:
        if quant is not None:
            use_checkpoint_fp8(model, quant, source)
        load_from(model, source, progress)
        if quant is not None:
            load_scales(model, source)
    finally:
        source.close()
    if cfg.quantization == WeightQuantization.fp8 and quant is None:
        quantize_linears(model)
    if cfg.quantization == WeightQuantization.int8 and quant is None:
        quantize_linears_int8(model)
    # the launcher refuses either without an LM head (rules_effect) and both together (lm_head_one_format); a score or
    # embedding head built from a config no rule saw is not quantized
    head = model.lm_head if isinstance(model.lm_head, ParallelLMHead) else None
    if cfg.fp8_lm_head and head is not None:
        head.quantize_fp8()
    if cfg.int8_lm_head and head is not None:
        head.quantize_int8()
    if (cfg.fp8_lm_head or cfg.int8_lm_head) and model.device.type == "cuda":
        torch.cuda.empty_cache()  # an untied head's 16-bit weight goes back before the KV cache is sized


def build_vision_tower(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                       tp: TpGroup = TpGroup()) -> Qwen2VisionTower:
    """A multimodal model's vision tower (Qwen2-VL, Qwen2.5-VL; visual.tp > 1: this rank's part of it),
    weights loaded: what an encoder server runs."""
    arch = VisionArch.from_dict(cfg.vision)
    tower = tower_class(arch)(arch, device, dtype, tp)  # Qwen2-VL's or Qwen2.5-VL's
    return load_checkpoint_module(tower, cfg, device, arch.num_params)


def build_audio_tower(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen2AudioTower:
    """Qwen2-Audio's audio tower, weights loaded: what an encoder server runs."""
    arch = AudioArch.from_dict(cfg.audio)
    tower = Qwen2AudioTower(arch, device, dtype)
    return load_checkpoint_module(tower, cfg, device, arch.num_params)
