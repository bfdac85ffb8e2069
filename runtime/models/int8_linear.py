"""int8 linear layers (model.quantization=int8): layers.py's tensor-parallel linears with their weight rounded at load
to int8 rows, a float32 scale per output channel of this rank (kernels/int8.quantize_rows), the inputs left in the
model's dtype (weight-only). Their `weight` is a kernels/int8.Int8Rows, which the `linear` op dispatches on, so the
decoder runs them unchanged. A row-parallel layer's rank holds a block of every row's columns and scales its own block
(its partial sums are scaled before the all-reduce adds them).

Why beside model.quantization=fp8 (e4m3 weights and activations): the same bytes a decode step reads, and SmolLM2's
top-1 agreement with float32 over 2,048 positions of this repository's docs (`scripts/fp8_accuracy.py`, 2026-12-07)
94.8% in bf16 with int8 rows against bf16's 96.8%, where e4m3 serves 88.5% (int8 rows with float32 activations: 96.1%).
Not its speed under load: no 8-bit tensor-core products (the weights are converted to x's dtype in the kernel)."""
from __future__ import annotations

import torch
from torch import nn

from llaunch.kernels.int8 import Int8Rows, quantize_rows
from llaunch.runtime.models.fp8_linear import float_linears
from llaunch.runtime.models.layers import ColumnParallelLinear, RowParallelLinear, quantize_by_rows


class Int8Layer:
    """What both int8 linears add: int8 `qweight` rows and their float32 `weight_scale`."""

    def _setup_int8(self, base: nn.Module) -> None:
        q, scale = quantize_by_rows(base.weight.detach(), torch.int8, quantize_rows, 4096)
        self.register_buffer("qweight", q)
        self.register_buffer("weight_scale", scale)

    @property
    def weight(self) -> Int8Rows:
        return Int8Rows(self.qweight, self.weight_scale)


class Int8ColumnParallelLinear(Int8Layer, ColumnParallelLinear):
    def __init__(self, base: ColumnParallelLinear):
        nn.Module.__init__(self)
        self.parts, self.in_features, self.bias = base.parts, base.in_features, base.bias
        self._setup_int8(base)


class Int8RowParallelLinear(Int8Layer, RowParallelLinear):
    def __init__(self, base: RowParallelLinear):
        nn.Module.__init__(self)
        self.name, self.tp, self.full_shape, self.in_parts = base.name, base.tp, base.full_shape, base.in_parts
        self.bias = base.bias
        self._setup_int8(base)


INT8_CLASSES = {ColumnParallelLinear: Int8ColumnParallelLinear, RowParallelLinear: Int8RowParallelLinear}


@torch.no_grad()
def quantize_linears_int8(model: nn.Module) -> None:
    """model.quantization=int8: every float decoder linear to int8 rows, one layer at a time so the float copy of only
    one is alive at once."""
    for parent, name, layer in float_linears(model):
        setattr(parent, name, INT8_CLASSES[type(layer)](layer))
    layer = None  # the last float layer: else its memory stays reserved past empty_cache
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the float weights' memory goes back before the KV cache is sized
