"""A yes/no reranker's head (model.score_head=yes_no, Qwen3-Reranker): a causal LM asked whether a document meets
a query answers at the last position of its prompt, and the relevance is P(yes) of the softmax over the "yes" and
"no" logits. That is sigmoid(logit(yes) - logit(no)), so the model is served as a score model with one output:
the two LM-head rows, replicated on every rank, and their difference (vLLM serves it the same way)."""
from __future__ import annotations

import torch
from torch import nn

from llaunch.runtime.models.layers import Shard


class YesNoHead(nn.Module):
    def __init__(self, token_ids: tuple[int, int], vocab_size: int, hidden_size: int, device, dtype):
        super().__init__()
        self.token_ids, self.vocab_size = tuple(token_ids), vocab_size
        self.weight = nn.Parameter(torch.empty((2, hidden_size), device=device, dtype=dtype), requires_grad=False)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        # lm_head rows (the embedding's when the checkpoint ties them: the loader's fallback)
        full = (self.vocab_size, self.weight.shape[1])
        return {"weight": [Shard("lm_head.weight", full, 0, t, 1) for t in self.token_ids]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x, self.weight).float()
        return logits[:, :1] - logits[:, 1:]  # [N, 1]: logit(yes) - logit(no)
