"""The start-up rules of mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral): their experts described, split
over the tensor-parallel ranks (a slice of every expert, or with parallel.ep whole experts), and the quantization
not implemented for them; and the MLP widths every model splits over the ranks (launcher/rules.py imports this)."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import LoadFormat
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.moe_config import MOE_FAMILIES, MOE_FIELDS, is_moe_layer

_NEEDED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _moe(cfg) -> bool:
    return cfg.model.family in MOE_FAMILIES


@rule(needs=("model.family",))
def moe_described(cfg):
    m = cfg.model
    if not serves(cfg):
        return
    if not _moe(cfg):
        if given := [f"model.{f}" for f in MOE_FIELDS if getattr(m, f) not in (None, 0, [])]:
            yield (*given, "model.family"), (
                f"{', '.join(given)} {'describe' if len(given) > 1 else 'describes'} experts, and model.family="
                f"{m.family!r} is a dense model; MoE families "
                f"are {', '.join(MOE_FAMILIES)}: unset them or serve an MoE checkpoint")
        return
    if unknown := [f"model.{f}" for f in _NEEDED if getattr(m, f) is None]:
        yield (*unknown, "model.family"), (
            f"model.family={m.family} is a mixture of experts and {', '.join(unknown)} unknown: give model.path "
            "(config.json says them), a sized profile (model=qwen3-30b-a3b | mixtral-8x7b) or set them")
        return
    if not 1 <= m.num_experts_per_tok <= m.num_experts or m.moe_intermediate_size < 1 \
            or (m.decoder_sparse_step is not None and m.decoder_sparse_step < 1):
        yield ("model.num_experts", "model.num_experts_per_tok", "model.moe_intermediate_size",
               "model.decoder_sparse_step"), (
            f"model.num_experts_per_tok={m.num_experts_per_tok} must be within 1..model.num_experts={m.num_experts}, "
            f"model.moe_intermediate_size={m.moe_intermediate_size} and model.decoder_sparse_step="
            f"{m.decoder_sparse_step} at least 1")


def _has_dense_layers(m) -> bool:
    if m.family not in MOE_FAMILIES:
        return True
    if m.num_hidden_layers is None or m.num_experts is None:
        return False
    return not all(is_moe_layer(i, m.num_experts, m.decoder_sparse_step or 1, m.mlp_only_layers or [])
                   for i in range(m.num_hidden_layers))


def _dividing(n: int, upto: int) -> str:
    return ", ".join(str(t) for t in range(1, max(upto, 8) + 1) if n % t == 0)


@rule(needs=("model.family",))
def mlp_splits_over_tp(cfg):
    """Every rank holds an equal share of each MLP's columns (and, with parallel.ep, of the experts)."""
    m, tp, ep = cfg.model, cfg.parallel.tp, cfg.parallel.ep
    if not serves(cfg) or tp < 1 or ep not in (1, tp):
        return  # parallel_sizes / expert_parallel_valid say why
    widths = []
    if _has_dense_layers(m) and m.intermediate_size:
        widths.append(("model.intermediate_size", m.intermediate_size))
    if _moe(cfg) and m.shared_expert_intermediate_size:
        widths.append(("model.shared_expert_intermediate_size", m.shared_expert_intermediate_size))
    for key, width in widths:
        if width % tp:
            yield (key, "parallel.tp"), (
                f"{key}={width} does not split over parallel.tp={tp} ranks (each holds an equal share of its "
                f"columns): use a parallel.tp of {_dividing(width, tp)}")
    if not _moe(cfg) or None in (m.num_experts, m.moe_intermediate_size):
        return
    if ep == 1 and m.moe_intermediate_size % tp:
        whole = f", or parallel.ep={tp} (whole experts on each rank)" if m.num_experts % tp == 0 else ""
        yield ("model.moe_intermediate_size", "parallel.tp", "parallel.ep"), (
            f"model.moe_intermediate_size={m.moe_intermediate_size} does not split over parallel.tp={tp} ranks "
            f"(each holds an equal slice of every expert's columns): use a parallel.tp of "
            f"{_dividing(m.moe_intermediate_size, tp)}{whole}")
    if ep > 1 and m.num_experts % tp:
        yield ("model.num_experts", "parallel.ep", "parallel.tp"), (
            f"parallel.ep={ep} gives each of the {tp} ranks whole experts, and model.num_experts={m.num_experts} "
            f"does not split over them: use a parallel.tp of {_dividing(m.num_experts, tp)}, or parallel.ep=1 "
            "(a slice of every expert on each rank)")


@rule()
def expert_parallel_valid(cfg):
    p, m = cfg.parallel, cfg.model
    if p.ep == 1 or not serves(cfg):
        return
    if p.ep != p.tp:
        yield ("parallel.ep", "parallel.tp"), (
            f"parallel.ep={p.ep} with parallel.tp={p.tp}: experts are split over the tensor-parallel ranks, "
            f"parallel.ep=1 (a slice of every expert on each rank) or parallel.ep={p.tp} (whole experts on each); "
            "experts spread over data-parallel replicas (tokens exchanged between them) are not implemented")
    elif m.family is not None and not _moe(cfg):
        yield ("parallel.ep", "model.family"), (
            f"parallel.ep={p.ep} splits experts, and model.family={m.family!r} has none: leave parallel.ep=1 "
            f"(MoE families: {', '.join(MOE_FAMILIES)})")


@rule(needs=("model.family",))
def moe_quantization_supported(cfg):
    m = cfg.model
    if not _moe(cfg) or not serves(cfg):
        return
    if m.quantization is not None:
        yield ("model.quantization", "model.family"), (
            f"model.quantization={m.quantization.value} with model.family={m.family}: {m.quantization.value} "
            "experts are not implemented; serve the model in its own dtype (unset model.quantization)")
    ckpt = read_checkpoint(m.path) if m.path and m.load_format != LoadFormat.dummy else None
    if ckpt is not None and ckpt.weight_quant is not None and ckpt.weight_quant.served:  # else: checkpoint_quantization_supported
        yield ("model.path", "model.family"), (
            f"model.path={m.path} is quantized ({ckpt.weight_quant.method}, config.json quantization_config) and "
            f"model.family={m.family}: quantized experts are not implemented; serve the bf16 checkpoint")
