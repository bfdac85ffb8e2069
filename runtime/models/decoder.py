"""The one decoder for Llama, Mistral, Qwen2 (Llama + q/k/v bias) and Qwen3 (Llama + an RMSNorm over each
q and k head before rotary), and their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (an MoE block in
place of the MLP: runtime/models/moe.py), over the token-slot KV cache. Gemma 2/3: (1 + w) norms around
attention and the MLP, GeGLU, the embedding scaled by sqrt(hidden_size), local sliding-window layers
interleaved with global ones (Gemma 3's on their own rotary base), soft-capped scores and logits (Gemma 2).
Phi-3/4: Llama's shape read from fused qkv_proj / gate_up_proj tensors, rotary on part of each head.

Sliding-window layers keep every token's K/V (the slot cache is per request, not per layer): the kernels read
only the window, but the memory is the whole context's, as for a global layer.

A forward step takes a decode-first ForwardBatch: decode tokens attend through `decode_attention`,
prefill chunks (possibly continuing a cached prefix) through `prefill_attention`; every token's K/V
is stored into its slot first. Only the rows in `logits_index` go through the final norm and LM head.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llaunch.kernels.dispatch import (decode_attention, gated_linear, gelu_tanh_mul, linear, prefill_attention,
                                      qkv_rotary_store_kv, rmsnorm, rope_cos_sin, rotary_store_kv, rows_of)
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.models.heads import HeadLayout
from llaunch.runtime.models.moe import SparseMoe
from llaunch.runtime.models.mrope import mrope_tables
from llaunch.runtime.models.pooling import HiddenHead
from llaunch.runtime.models.rerank_head import YesNoHead
from llaunch.runtime.models.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RowParallelLinear,
                                           Shard, TpGroup, VocabParallelEmbedding)


def head_parts(prefix: str, runs, head_dim: int, full: int, offset: int = 0) -> list:
    """ColumnParallelLinear parts for runs of heads (checkpoint head or None for zero heads), `offset` rows into
    the checkpoint tensor (a fused qkv_proj's k and v)."""
    return [(None if h is None else prefix, full, offset + (h or 0) * head_dim, n * head_dim) for h, n in runs]


def qkv_parts(arch: ModelArch, prefix: str, q_runs, kv_runs) -> list:
    """The fused q‖k‖v weight's parts: from q_proj, k_proj and v_proj, or from one qkv_proj (Phi-3)."""
    d = arch.head_dim
    q_full, kv_full = arch.num_attention_heads * d, arch.num_key_value_heads * d
    if arch.fused_projections:
        fused, total = f"{prefix}.qkv_proj", q_full + 2 * kv_full
        return [*head_parts(fused, q_runs, d, total), *head_parts(fused, kv_runs, d, total, q_full),
                *head_parts(fused, kv_runs, d, total, q_full + kv_full)]
    return [*head_parts(f"{prefix}.q_proj", q_runs, d, q_full), *head_parts(f"{prefix}.k_proj", kv_runs, d, kv_full),
            *head_parts(f"{prefix}.v_proj", kv_runs, d, kv_full)]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, prefix: str, tp: TpGroup, device, dtype, index: int = 0):
        """index: the layer's, which sets its window (arch.layer_window)."""
        super().__init__()
        d, hidden = arch.head_dim, arch.hidden_size
        heads = HeadLayout.of(arch.num_attention_heads, arch.num_key_value_heads, tp.size)
        self.num_heads, self.num_kv_heads = heads.heads_per_rank, heads.kv_heads_per_rank
        self.head_dim, self.scale = d, arch.attention_scale
        self.window, self.softcap = arch.layer_window(index), arch.attn_logit_softcapping or 0.0
        self.partial_rotary = arch.rotary_dim < d
        q_full = arch.num_attention_heads * d
        q_runs, kv_runs = heads.query_runs(tp.rank), heads.kv_runs(tp.rank)
        self.qkv_proj = ColumnParallelLinear(hidden, qkv_parts(arch, prefix, q_runs, kv_runs),
                                             bias=arch.attention_bias, device=device, dtype=dtype)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", q_full, 0, 0, hidden, bias=arch.o_proj_bias, tp=tp,
                                        device=device, dtype=dtype,
                                        in_parts=[(None if h is None else h * d, n * d) for h, n in q_runs])
        # Qwen3, Gemma 3: RMSNorm over each q / k head (weights [head_dim], the same for every head: replicated)
        norm = lambda name: RMSNorm(f"{prefix}.{name}", d, arch.rms_norm_eps, device, dtype,  # noqa: E731
                                    unit_offset=arch.gemma)
        self.q_norm = norm("q_norm") if arch.qk_norm else None
        self.k_norm = norm("k_norm") if arch.qk_norm else None
        self.kv_scales = None  # an fp8 KV cache's scales for this layer (runtime/models/kv_fp8.py)

    def project(self, x: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x → (q [T, Hq, D] rotated, k, v): every token's K/V stored at its slot first; k, v are an fp8 cache's
        chunk unrounded (prefill attention reads them), else None. Device work of fixed shapes only (a piece of a
        mixed step's CUDA graphs: runtime/worker/mixed_graphs.py)."""
        t, d = rows_of(x), self.head_dim
        if self.q_norm is None and not self.partial_rotary:
            return qkv_rotary_store_kv(x, self.qkv_proj.weight, self.qkv_proj.bias, self.num_heads, self.num_kv_heads,
                                       positions, cos, sin, k_cache, v_cache, out_slots, self.kv_scales, with_kv=True)
        q, k, v = linear(x, self.qkv_proj.weight, self.qkv_proj.bias).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, k = q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d)
        # q / k heads RMSNorm'd (in the rotary kernel on a GPU); partial rotary: tables of rotary_dim / 2 columns
        # rotate the leading rotary_dim dims of each head
        norms = {} if self.q_norm is None else dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight,
                                                    eps=self.q_norm.eps)
        return rotary_store_kv(q, k, v.view(t, self.num_kv_heads, d), positions, cos, sin, k_cache, v_cache, out_slots,
                               self.kv_scales, with_kv=True, **norms)

    def attend(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], batch: ForwardBatch,
               k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slots: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention of the step's tokens over the cache → [T, Hq * D] (into `out`, [T, Hq, D], when given:
        rows past the step's tokens keep what they held). Decode tokens attend through `decode_attention`, prefill
        chunks through `prefill_attention`; q may have more rows than the step has tokens (a padded step)."""
        d = self.head_dim
        nd = batch.num_decode
        if not batch.num_prefill_tokens:  # a decode-only step
            into = None if out is None else out[:nd]
            decoded = decode_attention(q[:nd], k_cache, v_cache, req_to_slots, batch.decode_rows, batch.decode_seq_lens,
                                       self.scale, max_len=batch.max_decode_len or None, kv_scales=self.kv_scales,
                                       window=self.window, softcap=self.softcap, out=into)
            out = decoded if out is None else out
            return out.view(out.shape[0], self.num_heads * d)
        # q_starts index the whole token array, so the prefill op gets all of q; decode rows come first.
        out = prefill_attention(q, k_cache, v_cache, req_to_slots, batch.prefill_rows, batch.prefill_q_starts,
                                batch.prefill_q_lens, batch.prefill_prefix_lens, self.scale,
                                max_q_len=batch.max_prefill_len or None, kv_scales=self.kv_scales, new_kv=(k, v),
                                window=self.window, softcap=self.softcap, out=out)
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, req_to_slots, batch.decode_rows, batch.decode_seq_lens,
                             self.scale, max_len=batch.max_decode_len or None, kv_scales=self.kv_scales,
                             window=self.window, softcap=self.softcap, out=out[:nd])
        return out.view(out.shape[0], self.num_heads * d)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                req_to_slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, batch.positions, batch.out_slots, k_cache, v_cache, cos, sin)
        return self.o_proj(self.attend(q, k, v, batch, k_cache, v_cache, req_to_slots))


class Mlp(nn.Module):
    """gate/up/down of `intermediate_size` (the dense layers' by default; Qwen2-MoE's shared expert's)."""

    def __init__(self, arch: ModelArch, prefix: str, tp: TpGroup, device, dtype,
                 intermediate_size: Optional[int] = None, what: str = "intermediate_size"):
        super().__init__()
        full = intermediate_size or arch.intermediate_size
        start, local = tp.split(full, what)
        if arch.fused_projections:  # Phi-3's gate_up_proj [2I, H]: this rank's gate rows, then its up rows
            parts = [(f"{prefix}.gate_up_proj", 2 * full, start, local),
                     (f"{prefix}.gate_up_proj", 2 * full, full + start, local)]
        else:
            parts = [(f"{prefix}.gate_proj", full, start, local), (f"{prefix}.up_proj", full, start, local)]
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, parts, bias=False, device=device, dtype=dtype)
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", full, start, local, arch.hidden_size,
                                           bias=False, tp=tp, device=device, dtype=dtype)
        self.geglu = arch.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, reduce: bool = True, unscaled: bool = False):
        """unscaled: the output goes to the next RMSNorm with the residual, so an fp8 down_proj may return its
        ScaledSums (RowParallelLinear's)."""
        if self.geglu:  # Gemma
            return self.down_proj(gelu_tanh_mul(linear(x, self.gate_up_proj.weight)), reduce, unscaled)
        # gate_up's bias is always absent (Llama, Qwen2), so the fused gated GEMV needs none.
        return self.down_proj(gated_linear(x, self.gate_up_proj.weight, self.down_proj.weight), reduce, unscaled)


class DecoderLayer(nn.Module):
    """norm → attention → norm → MLP with the residual adds fused into the norms; Gemma's sandwich: norm →
    attention → norm (post_attention_layernorm, before the add) → pre_feedforward_layernorm → MLP →
    post_feedforward_layernorm (before the add)."""

    def __init__(self, arch: ModelArch, index: int, tp: TpGroup, device, dtype, expert_parallel: bool = False):
        super().__init__()
        prefix = f"model.layers.{index}"

        def norm(name):
            return RMSNorm(f"{prefix}.{name}", arch.hidden_size, arch.rms_norm_eps, device, dtype,
                           unit_offset=arch.gemma)

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = Attention(arch, f"{prefix}.self_attn", tp, device, dtype, index)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.sandwich = arch.gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        if arch.is_moe_layer(index):
            shared = arch.shared_expert_intermediate_size
            self.mlp = SparseMoe(arch, f"{prefix}.mlp", tp, expert_parallel, device, dtype, shared_expert=Mlp(
                arch, f"{prefix}.mlp.shared_expert", tp, device, dtype, shared, "shared_expert_intermediate_size")
                if shared else None)
        else:
            self.mlp = Mlp(arch, f"{prefix}.mlp", tp, device, dtype)

    def attention_input(self, h: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                        out_slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor):
        """(h, residual) → (q, k, v, residual): the input norm (adding h to the residual stream) and the q/k/v
        projection, K/V stored (Attention.project)."""
        into = self.self_attn.qkv_proj.weight  # an fp8 q‖k‖v may take x quantized by the norm (kernels.fp8_fused_norm)
        if residual is None:
            x, residual = self.input_layernorm(h, into=into), h
        else:
            x, residual = self.input_layernorm(h, residual, into=into)
        return (*self.self_attn.project(x, positions, out_slots, k_cache, v_cache, cos, sin), residual)

    def attention_output(self, attn: torch.Tensor, residual: torch.Tensor, to_norm: bool = False):
        """The attention's output [T, Hq * D] → (this layer's output, the residual stream before it is added):
        o_proj, norm, MLP; the next norm adds them. to_norm: the output goes to the next layer's input norm, which
        takes an fp8 down_proj's ScaledSums (as the norm here takes o_proj's: kernels.fp8_norm_epilogue)."""
        if self.sandwich:
            h = self.self_attn.o_proj(attn)
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        h = self.self_attn.o_proj(attn, unscaled=True)
        dense = isinstance(self.mlp, Mlp)
        into = self.mlp.gate_up_proj.weight if dense else None  # as for q‖k‖v
        x, residual = self.post_attention_layernorm(h, residual, into=into)
        return self.mlp(x, unscaled=True) if dense and to_norm else self.mlp(x), residual


class ScoreHead(nn.Module):
    """transformers' `score` Linear(hidden, num_labels, bias=False) of *ForSequenceClassification,
    replicated on every rank (its input, the final norm's output, is whole on each); float32 out."""

    def __init__(self, hidden_size: int, num_labels: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num_labels, hidden_size), device=device, dtype=dtype),
                                   requires_grad=False)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        return {"weight": [Shard("score.weight", tuple(self.weight.shape))]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight).float()


class RewardHead(nn.Module):
    """Qwen2ForRewardModel's `score`: Linear(h, h) + ReLU + Linear(h, num_labels), both with bias
    (Qwen2.5-Math-RM's remote code, as vLLM and LightLLM serve it), replicated on every rank; float32 out."""

    def __init__(self, hidden_size: int, num_labels: int, device, dtype):
        super().__init__()

        def param(*shape):
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)

        self.up_weight, self.up_bias = param(hidden_size, hidden_size), param(hidden_size)
        self.down_weight, self.down_bias = param(num_labels, hidden_size), param(num_labels)

    def checkpoint_shards(self) -> dict[str, list[Shard]]:
        names = {"up_weight": "score.0.weight", "up_bias": "score.0.bias",
                 "down_weight": "score.2.weight", "down_bias": "score.2.bias"}
        return {local: [Shard(name, tuple(getattr(self, local).shape))] for local, name in names.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        return F.linear(F.relu(F.linear(x, self.up_weight, self.up_bias)), self.down_weight, self.down_bias).float()


class DecoderLM(nn.Module):
    """Embedding → N × (norm, attention, norm, MLP) with fused residual adds → norm → LM head."""

    def __init__(self, arch: ModelArch, tp: TpGroup, device: torch.device, dtype: torch.dtype,
                 max_positions: int, expert_parallel: bool = False):
        """expert_parallel: MoE layers give each tp rank whole experts instead of a slice of each (parallel.ep)."""
        super().__init__()
        self.arch, self.tp, self.device, self.dtype = arch, tp, torch.device(device), dtype
        self.kv_dtype = dtype  # the KV cache's (float8_e4m3fn: runtime/models/kv_fp8.py)
        self.embed_tokens = VocabParallelEmbedding("model.embed_tokens", arch.vocab_size, arch.hidden_size, tp,
                                                   device, dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp, device, dtype, expert_parallel)
                                    for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm("model.norm", arch.hidden_size, arch.rms_norm_eps, device, dtype, unit_offset=arch.gemma)
        # a score model's rows go through its score head instead: [N, num_labels] instead of [N, vocab]
        if arch.score_token_ids:  # a yes/no reranker: two LM-head rows
            self.lm_head = YesNoHead(arch.score_token_ids, arch.vocab_size, arch.hidden_size, device, dtype)
        elif arch.num_labels:
            head = RewardHead if arch.score_mlp else ScoreHead
            self.lm_head = head(arch.hidden_size, arch.num_labels, device, dtype)
        elif arch.embed:  # an embedding model: the final norm's output, pooled by the worker
            self.lm_head = HiddenHead()
        else:
            self.lm_head = ParallelLMHead("lm_head", self.embed_tokens, arch.tie_word_embeddings, device, dtype)
        cos, sin = rope_cos_sin(arch.rotary_dim, max_positions, arch.rope_theta, arch.rope_scaling, device=device,
                                max_position_embeddings=arch.max_position_embeddings)
        cos, sin = cos.to(dtype), sin.to(dtype)  # transformers rounds its tables to the model dtype too
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.local_rope = arch.rope_local_base_freq is not None  # Gemma 3: sliding layers' own plain-RoPE tables
        if self.local_rope:
            cos, sin = rope_cos_sin(arch.rotary_dim, max_positions, arch.rope_local_base_freq, device=device)
            self.register_buffer("rope_local_cos", cos.to(dtype), persistent=False)
            self.register_buffer("rope_local_sin", sin.to(dtype), persistent=False)
        # Gemma: the embedding times sqrt(hidden_size), rounded to the model dtype as transformers does
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size ** 0.5).to(device, dtype) if arch.gemma
                             else None, persistent=False)
        self.final_softcap = arch.final_logit_softcapping if isinstance(self.lm_head, ParallelLMHead) else None
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads if arch.num_hidden_layers else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes on this rank, over all layers."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.arch.num_hidden_layers * self.num_local_kv_heads * self.arch.head_dim * itemsize

    def make_kv_cache(self, num_slots: int, max_rows: int, max_model_len: int) -> KvCache:
        shape = (num_slots, self.num_local_kv_heads, self.arch.head_dim)
        n = self.arch.num_hidden_layers
        return KvCache(
            k=[torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in range(n)],
            v=[torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in range(n)],
            req_to_slots=torch.zeros((max_rows, max_model_len), device=self.device, dtype=torch.int32),
        )

    def checkpoint_layout(self) -> dict[str, list[Shard]]:
        """Local parameter name → the checkpoint slices that fill it (what loaders read)."""
        layout = {}
        for prefix, module in self.named_modules():
            if hasattr(module, "checkpoint_shards"):
                for pname, shards in module.checkpoint_shards().items():
                    layout[f"{prefix}.{pname}" if prefix else pname] = shards
        return layout

    def embed(self, input_ids: torch.Tensor, image_index: Optional[torch.Tensor] = None,
              image_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's input embeddings [T, hidden] (images' embeddings in place of their tokens)."""
        if image_index is None:
            h = self.embed_tokens(input_ids)
        else:  # image tokens' ids are vocab_size + a hash: embed a real id, then put the image there
            h = self.embed_tokens(torch.where(input_ids < self.arch.vocab_size, input_ids, torch.zeros_like(input_ids)))
            h[image_index] = image_embeds.to(h.dtype)
        return h if self.embed_scale is None else h * self.embed_scale

    def piece(self, i: int, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
              out_slots: torch.Tensor, kv: KvCache, cos: torch.Tensor, sin: torch.Tensor):
        """The step's work between attention i - 1 and attention i, which has fixed shapes and no host input (a
        mixed step replays each from a CUDA graph: runtime/worker/mixed_graphs.py): x, attention i - 1's output
        (piece 0: the embeddings), through layer i - 1's o_proj, norm and MLP, then layer i's norm and q/k/v
        projection → (q, k, v, residual); the last piece (i = num_hidden_layers) → (h, None, None, residual)."""
        h = x if i == 0 else None
        if i > 0:
            h, residual = self.layers[i - 1].attention_output(x, residual, to_norm=i < len(self.layers))
        if i == len(self.layers):
            return h, None, None, residual
        if self.local_rope and self.arch.is_sliding_layer(i):
            cos, sin = self.rope_local_cos, self.rope_local_sin
        return self.layers[i].attention_input(h, residual, positions, out_slots, kv.k[i], kv.v[i], cos, sin)

    def rope_inputs(self, batch: ForwardBatch):
        """(positions, cos, sin) the pieces rotate by: M-RoPE's per-token tables indexed by each token's place."""
        if batch.mrope_positions is None:
            return batch.positions, self.rope_cos, self.rope_sin
        cos, sin = mrope_tables(self.rope_cos, self.rope_sin, batch.mrope_positions, self.arch.mrope_section)
        return torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device), cos, sin

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KvCache) -> torch.Tensor:
        """→ float32 logits [len(batch.logits_index), vocab] (a score model: [.., num_labels] scores)."""
        positions, cos, sin = self.rope_inputs(batch)
        x, residual = self.embed(batch.input_ids, batch.image_index, batch.image_embeds), None
        for i in range(len(self.layers) + 1):
            x, k, v, residual = self.piece(i, x, residual, positions, batch.out_slots, kv, cos, sin)
            if i < len(self.layers):
                x = self.layers[i].self_attn.attend(x, k, v, batch, kv.k[i], kv.v[i], kv.req_to_slots)
        return self.head(x, residual, batch)

    def head(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """The last layer's output and residual → the logits of the rows in batch.logits_index."""
        rows = batch.logits_index
        if residual is not None and batch.every_token:
            # the residual add is the final norm's: one kernel instead of two gathers, an add and the norm
            return self._capped(self.lm_head(self.norm(h, residual)[0]))
        h = h[rows] if residual is None else h[rows] + residual[rows]
        return self._capped(self.lm_head(self.norm(h)))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final logit soft-capping: cap · tanh(logit / cap)."""
        if not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
