"""fp8 linear layers: layers.py's tensor-parallel linears with e4m3 weights and one float32 scale per
output channel, filled from an fp8 checkpoint (weight + weight_scale [+ input_scale]) or by
quantizing a loaded model (model.quantization=fp8). Their `weight` is a kernels/fp8.Fp8Weight, which
the `linear` op dispatches on, so the decoder runs them unchanged.

Sharding follows the weights: a column-parallel layer's scales are its rows' (a per-tensor scale of
a fused q‖k‖v is expanded to its rows), a row-parallel layer keeps every output channel's scale.
A static input_scale of a fused layer is the largest of its parts' (they share one input).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from llaunch.kernels.fp8 import DYNAMIC, FP8, STATIC, Fp8Weight, quantize_weight
from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, Shard
from llaunch.runtime.models.quant_scheme import WeightQuant


class Fp8Layer:
    """What both fp8 linears add: an e4m3 `qweight` (loaded as the checkpoint's `.weight`), scales."""

    def _setup_fp8(self, out_features: int, in_features: int, device, activations: str,
                   scale_ub: Optional[float]) -> None:
        self.qweight = nn.Parameter(torch.zeros((out_features, in_features), dtype=FP8, device=device),
                                    requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        self.activations, self.scale_ub = activations, scale_ub

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.weight_scale, self.activations, self.input_scale, self.scale_ub)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        shards = super().checkpoint_shards()  # the float layer's, with the weight loaded into qweight
        shards["qweight"] = shards.pop("weight")
        return shards

    def scale_parts(self) -> list[tuple[Optional[str], int, int, int]]:
        """(checkpoint prefix or None for zero rows, full out features, local start, local size)."""
        raise NotImplementedError


class Fp8ColumnParallelLinear(Fp8Layer, ColumnParallelLinear):
    def __init__(self, base: ColumnParallelLinear, activations: str = DYNAMIC, scale_ub: Optional[float] = None):
        nn.Module.__init__(self)
        self.parts, self.in_features, self.bias = base.parts, base.in_features, base.bias
        self._setup_fp8(base.weight.shape[0], base.in_features, base.weight.device, activations, scale_ub)

    def scale_parts(self):
        return list(self.parts)


class Fp8RowParallelLinear(Fp8Layer, RowParallelLinear):
    def __init__(self, base: RowParallelLinear, activations: str = DYNAMIC, scale_ub: Optional[float] = None):
        nn.Module.__init__(self)
        self.name, self.tp, self.full_shape, self.in_parts = base.name, base.tp, base.full_shape, base.in_parts
        self.bias = base.bias
        self._setup_fp8(base.weight.shape[0], base.weight.shape[1], base.weight.device, activations, scale_ub)

    def scale_parts(self):
        return [(self.name, self.full_shape[0], 0, self.full_shape[0])]


FP8_CLASSES = {ColumnParallelLinear: Fp8ColumnParallelLinear, RowParallelLinear: Fp8RowParallelLinear}


def float_linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every decoder linear still in float (not the LM or score head)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in FP8_CLASSES:
                yield parent, name, child


def _prefixes(layer) -> list[str]:
    if isinstance(layer, ColumnParallelLinear):
        return [p for p, *_ in layer.parts if p is not None]
    return [layer.name]


def use_checkpoint_fp8(model: nn.Module, quant: WeightQuant, source) -> None:
    """Swap in an fp8 layer for every linear whose checkpoint tensors carry a weight_scale (a module in
    the quantization_config's ignore list has none and stays in float)."""
    for parent, name, layer in float_linears(model):
        prefixes = _prefixes(layer)
        scaled = [source.has(f"{p}.weight_scale") for p in prefixes]
        if not any(scaled):
            continue
        if not all(scaled):
            raise ValueError(f"{', '.join(prefixes)} are fused into one layer but only some have a weight_scale")
        probe = source.read(Shard(f"{prefixes[0]}.weight", _full_shape(layer, prefixes[0]), 0, 0, 1))
        if probe.dtype != FP8:
            raise ValueError(f"{prefixes[0]}.weight is {probe.dtype} with a weight_scale: only float8_e4m3fn "
                             "weights are served")
        setattr(parent, name, FP8_CLASSES[type(layer)](layer, quant.activations, quant.activation_scale_ub))


def _full_shape(layer, prefix: str) -> tuple[int, int]:
    if isinstance(layer, ColumnParallelLinear):
        full = next(f for p, f, *_ in layer.parts if p == prefix)
        return (full, layer.in_features)
    return layer.full_shape


def load_scales(model: nn.Module, source) -> None:
    """Fill the fp8 layers' weight_scale (and a static input_scale) from the checkpoint."""
    for layer in model.modules():
        if not isinstance(layer, Fp8Layer):
            continue
        scales = []
        for prefix, full, start, size in layer.scale_parts():
            if prefix is None:
                scales.append(torch.ones(size))
                continue
            s = source.read_whole(f"{prefix}.weight_scale").float().reshape(-1)
            if s.numel() == 1:  # per tensor: every row of this part shares it
                scales.append(s.expand(size))
            elif s.numel() == full:  # per output channel ([out, 1] or [out])
                scales.append(s[start:start + size])
            else:
                raise ValueError(f"{prefix}.weight_scale has {s.numel()} values; expected 1 or {full} "
                                 "(per tensor or per output channel)")
        with torch.no_grad():
            layer.weight_scale.copy_(torch.cat(scales))
            if layer.activations == STATIC:
                layer.input_scale.fill_(max(source.read_whole(f"{p}.input_scale").float().max().item()
                                            for p in _prefixes(layer)))


@torch.no_grad()
def quantize_linears(model: nn.Module) -> None:
    """model.quantization=fp8: every float decoder linear to e4m3 with per-channel scales (dynamic
    per-token activations), one layer at a time so the float copy of only one is alive at once."""
    for parent, name, layer in float_linears(model):
        fp8 = FP8_CLASSES[type(layer)](layer, DYNAMIC)
        q, scale = quantize_weight(layer.weight)
        fp8.qweight.copy_(q)
        fp8.weight_scale.copy_(scale)
        setattr(parent, name, fp8)
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the float weights' memory goes back before the KV cache is sized
