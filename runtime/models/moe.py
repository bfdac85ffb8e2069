"""The sparse MoE block of Qwen2-MoE, Qwen3-MoE and Mixtral: a router (Linear hidden → experts, replicated on
every rank), each token's top-k experts of its softmax, their SiLU-gated MLPs weighted and summed
(kernels fused_moe), and Qwen2-MoE's shared expert, which every token goes through, scaled by
sigmoid(shared_expert_gate(x)).

Tensor parallel: every rank holds a slice of each expert's intermediate columns (as the dense MLP's gate/up
and down split), or with expert parallelism (parallel.ep = tp) whole experts, num_experts / tp of them. Either way
a rank's output is a partial sum for every token, and one all-reduce adds the ranks' partials (the shared
expert's too) after the block.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llaunch.kernels.dispatch import fused_moe, linear, moe_route
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.layers import Shard, TpGroup


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Experts(nn.Module):
    """This rank's share of the routed experts, stacked: w13 [E_local, 2 I_local, H] (each expert's gate rows, then
    its up rows) and w2 [E_local, H, I_local], read from transformers 5's stacked tensors (weights.py stacks the
    per-expert ones other versions write: checkpoint.per_expert_names)."""

    def __init__(self, arch: ModelArch, prefix: str, tp: TpGroup, expert_parallel: bool, device, dtype):
        super().__init__()
        e, inter, h = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        self.gate_up_name, self.down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_shape, self.down_shape = (e, 2 * inter, h), (e, h, inter)
        if expert_parallel:  # whole experts: [first, first + local)
            first, local = tp.split(e, "num_experts")
            self.expert_start = first
            self.gate_up_shards = [Shard(self.gate_up_name, self.gate_up_shape, 0, first, local)]
            self.down_shards = [Shard(self.down_name, self.down_shape, 0, first, local)]
            shape13, shape2 = (local, 2 * inter, h), (local, h, inter)
        else:  # every expert's intermediate columns [start, start + local)
            start, local = tp.split(inter, "moe_intermediate_size")
            self.expert_start = None
            self.gate_up_shards = [Shard(self.gate_up_name, self.gate_up_shape, 1, start, local),
                                   Shard(self.gate_up_name, self.gate_up_shape, 1, inter + start, local)]
            self.down_shards = [Shard(self.down_name, self.down_shape, 2, start, local)]
            shape13, shape2 = (e, 2 * local, h), (e, h, local)
        self.w13 = _param(shape13, device, dtype)
        self.w2 = _param(shape2, device, dtype)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        return {"w13": self.gate_up_shards, "w2": self.down_shards}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, weights, ids, self.expert_start)


class Replicated(nn.Module):
    """A small bias-free Linear whole on every rank (the router, the shared expert's gate): its input is whole."""

    def __init__(self, name: str, out_features: int, in_features: int, device, dtype):
        super().__init__()
        self.name = name
        self.weight = _param((out_features, in_features), device, dtype)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        return {"weight": [Shard(self.name, tuple(self.weight.shape))]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class SparseMoe(nn.Module):
    """`shared_expert`: Qwen2-MoE's dense MLP (the decoder's Mlp, named <prefix>.shared_expert), or None."""

    def __init__(self, arch: ModelArch, prefix: str, tp: TpGroup, expert_parallel: bool, device, dtype,
                 shared_expert: Optional[nn.Module] = None):
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = Replicated(f"{prefix}.gate.weight", arch.num_experts, arch.hidden_size, device, dtype)
        self.experts = Experts(arch, f"{prefix}.experts", tp, expert_parallel, device, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else \
            Replicated(f"{prefix}.shared_expert_gate.weight", 1, arch.hidden_size, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:  # its down projection's partial sum joins the experts' before the reduce
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return self.tp.all_reduce(out)
