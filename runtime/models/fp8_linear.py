"""fp8 linear layers: layers.py's tensor-parallel linears with e4m3 weights and float32 scales, one
per output channel or, for block-wise checkpoints, one per block of rows × columns, filled from an
fp8 checkpoint (weight + weight_scale or weight_scale_inv [+ input_scale]) or by quantizing a loaded
model (model.quantization=fp8: per channel). Their `weight` is a kernels/fp8.Fp8Weight, which the
`linear` op dispatches on, so the decoder runs them unchanged.

Sharding follows the weights: a column-parallel layer's scales are its rows' (a per-tensor scale of
a fused q‖k‖v is expanded to its rows), a row-parallel layer keeps every output channel's scale.
A static input_scale of a fused layer is the largest of its parts' (they share one input).

Block-wise scales are held per block of this rank's rows where every part of the layer starts on a
block boundary (Qwen2-7B's q‖k‖v and gate‖up at tp 1, 2, 4), else one row per weight row holding its
block's scales (k_proj split mid-block, fused parts narrower than a block): the kernels take either.
A row-parallel layer's input columns must split on block boundaries, since each rank quantizes its
activations per block of columns (launcher/rules_quant.py refuses a tp that does not).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from llaunch.kernels.fp8 import FP8, STATIC, Fp8Weight, quantize_weight
from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, Shard
from llaunch.runtime.models.quant_scheme import WeightQuant, splits_blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Layer:
    """What both fp8 linears add: an e4m3 `qweight` (loaded as the checkpoint's `.weight`), scales."""

    def _setup_fp8(self, out_features: int, in_features: int, device, quant: Optional[WeightQuant]) -> None:
        self.qweight = nn.Parameter(torch.zeros((out_features, in_features), dtype=FP8, device=device),
                                    requires_grad=False)
        quant = quant or WeightQuant("fp8")  # model.quantization=fp8: per channel, dynamic
        self.activations, self.scale_ub = quant.activations, quant.activation_scale_ub
        self.scale_name = quant.scale_name
        self.checkpoint_block = block = quant.block
        if block is None:
            self.block, scale_shape = None, (out_features,)
        else:
            group_n = block[0] if self._parts_start_on_blocks(block[0]) else 1
            self.block = (group_n, block[1])
            scale_shape = (_cdiv(out_features, group_n), _cdiv(in_features, block[1]))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.weight_scale, self.activations, self.input_scale, self.scale_ub,
                         self.block)

    def _parts_start_on_blocks(self, rows: int) -> bool:
        """Whether every part's first row, in the checkpoint and in this layer, begins a block of rows."""
        parts = self.scale_parts()
        return all(start % rows == 0 for *_, start, _ in parts) and all(size % rows == 0 for *_, size in parts[:-1])

    def block_rows(self) -> list[tuple[Optional[str], int]]:
        """(checkpoint prefix or None, its block row) of each local row of block scales: one per
        self.block[0] local rows (a whole block, or one row)."""
        rows, step = self.checkpoint_block[0], self.block[0]
        return [(prefix, (start + i) // rows) for prefix, _, start, size in self.scale_parts()
                for i in range(0, size, step)]

    def block_columns(self) -> list[Optional[int]]:
        """The checkpoint's block column of each local block of input columns (None: zero columns)."""
        return list(range(_cdiv(self.qweight.shape[1], self.block[1])))

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        shards = super().checkpoint_shards()  # the float layer's, with the weight loaded into qweight
        shards["qweight"] = shards.pop("weight")
        return shards

    def scale_parts(self) -> list[tuple[Optional[str], int, int, int]]:
        """(checkpoint prefix or None for zero rows, full out features, local start, local size)."""
        raise NotImplementedError


class Fp8ColumnParallelLinear(Fp8Layer, ColumnParallelLinear):
    def __init__(self, base: ColumnParallelLinear, quant: Optional[WeightQuant] = None):
        nn.Module.__init__(self)
        self.parts, self.in_features, self.bias = base.parts, base.in_features, base.bias
        self._setup_fp8(base.weight.shape[0], base.in_features, base.weight.device, quant)

    def scale_parts(self):
        return list(self.parts)


class Fp8RowParallelLinear(Fp8Layer, RowParallelLinear):
    def __init__(self, base: RowParallelLinear, quant: Optional[WeightQuant] = None):
        nn.Module.__init__(self)
        self.name, self.tp, self.full_shape, self.in_parts = base.name, base.tp, base.full_shape, base.in_parts
        self.bias = base.bias
        if quant is not None and quant.block is not None and splits_blocks(self.in_parts, quant.block[1]):
            raise ValueError(f"{self.name}: tensor-parallel rank {self.tp.rank} of {self.tp.size} holds input columns "
                             f"{self.in_parts} (start, count), which cut the checkpoint's blocks of {quant.block[1]} "
                             "columns (the launcher refuses this tp: rule checkpoint_quantization_supported)")
        self._setup_fp8(base.weight.shape[0], base.weight.shape[1], base.weight.device, quant)

    def scale_parts(self):
        return [(self.name, self.full_shape[0], 0, self.full_shape[0])]

    def block_columns(self) -> list[Optional[int]]:
        columns = self.block[1]
        return [None if start is None else start // columns + i
                for start, n in self.in_parts for i in range(_cdiv(n, columns))]


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
    """Swap in an fp8 layer for every linear whose checkpoint tensors carry a weight_scale (or
    weight_scale_inv: quant.scale_name; a module in the quantization_config's ignore list has none and
    stays in float)."""
    for parent, name, layer in float_linears(model):
        prefixes = _prefixes(layer)
        scaled = [source.has(f"{p}.{quant.scale_name}") for p in prefixes]
        if not any(scaled):
            continue
        if not all(scaled):
            raise ValueError(f"{', '.join(prefixes)} are fused into one layer but only some have a {quant.scale_name}")
        probe = source.read(Shard(f"{prefixes[0]}.weight", _full_shape(layer, prefixes[0]), 0, 0, 1))
        if probe.dtype != FP8:
            raise ValueError(f"{prefixes[0]}.weight is {probe.dtype} with a {quant.scale_name}: only float8_e4m3fn "
                             "weights are served")
        setattr(parent, name, FP8_CLASSES[type(layer)](layer, quant))


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
        scales = _block_scales(layer, source) if layer.block is not None else _channel_scales(layer, source)
        with torch.no_grad():
            layer.weight_scale.copy_(scales)
            if layer.activations == STATIC:
                layer.input_scale.fill_(max(source.read_whole(f"{p}.input_scale").float().max().item()
                                            for p in _prefixes(layer)))


def _channel_scales(layer: Fp8Layer, source) -> torch.Tensor:
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
    return torch.cat(scales)


def _block_scales(layer: Fp8Layer, source) -> torch.Tensor:
    """This rank's block scales: each part's checkpoint table [ceil(out / rows), ceil(in / columns)]
    gathered at the layer's local block rows and columns (zero rows and columns get 1)."""
    rows, cols = layer.checkpoint_block
    full_in = layer.in_features if isinstance(layer, ColumnParallelLinear) else layer.full_shape[1]
    tables, first_row = [], {}
    for prefix, full, *_ in layer.scale_parts():
        if prefix is None or prefix in first_row:
            continue
        t = source.read_whole(f"{prefix}.{layer.scale_name}").float()
        want = (_cdiv(full, rows), _cdiv(full_in, cols))
        if tuple(t.shape) != want:
            raise ValueError(f"{prefix}.{layer.scale_name} has shape {tuple(t.shape)}; blocks of {rows}x{cols} over "
                             f"{full}x{full_in} need {want}")
        first_row[prefix] = sum(len(x) for x in tables)
        tables.append(t)
    row_index = torch.tensor([-1 if p is None else first_row[p] + r for p, r in layer.block_rows()])
    col_index = torch.tensor([-1 if c is None else c for c in layer.block_columns()])
    gathered = torch.cat(tables)[row_index.clamp(min=0)][:, col_index.clamp(min=0)]
    return torch.where((row_index >= 0)[:, None] & (col_index >= 0)[None, :], gathered, 1.0)


@torch.no_grad()
def quantize_linears(model: nn.Module) -> None:
    """model.quantization=fp8: every float decoder linear to e4m3 with per-channel scales (dynamic
    per-token activations), one layer at a time so the float copy of only one is alive at once."""
    for parent, name, layer in float_linears(model):
        fp8 = FP8_CLASSES[type(layer)](layer)
        q, scale = quantize_weight(layer.weight)
        fp8.qweight.copy_(q)
        fp8.weight_scale.copy_(scale)
        setattr(parent, name, fp8)
    layer = q = None  # the last float layer and its e4m3 copy: else their memory stays reserved past empty_cache
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the float weights' memory goes back before the KV cache is sized
