"""What a checkpoint's `quantization_config` (config.json) asks for, read as JSON without torch: the
launcher refuses at plan time what llaunch does not run (a quantized checkpoint read as if it were
not serves wrong text), and the worker builds its fp8 linear layers from the same parse.

Served: float8_e4m3fn weights with a `weight_scale` per output channel ([out, 1]) or per tensor, in
the layouts of compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC), FBGEMM (`fbgemm_fp8`) and the
plain `fp8` one (AutoFP8, vLLM's); activations quantized per token at run time, with a static
per-tensor `input_scale`, or not at all (weight-only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED = ("compressed-tensors float-quantized fp8 (weights e4m3 per channel or per tensor; activations "
             "dynamic per token, static per tensor, or none), fbgemm_fp8, fp8 (weight_scale per channel or "
             "tensor, activation_scheme dynamic | static; no weight_block_size)")
# activation modes of an fp8 linear layer
DYNAMIC, STATIC, NONE = "dynamic", "static", "none"


@dataclass(frozen=True)
class WeightQuant:
    """One checkpoint's weight quantization, or why llaunch cannot serve it (`problems`)."""

    method: str  # quantization_config's quant_method, as written
    activations: str = DYNAMIC  # dynamic (per-token scales) | static (the checkpoint's input_scale) | none
    activation_scale_ub: Optional[float] = None  # fbgemm_fp8: per-token absmax is clipped to this
    problems: list[str] = field(default_factory=list)

    @property
    def served(self) -> bool:
        return not self.problems


def quantization_config(config: dict[str, Any]) -> Optional[dict[str, Any]]:
    """config.json's quantization_config, also where transformers 5 nests it in a text_config."""
    q = config.get("quantization_config")
    text = config.get("text_config")
    if q is None and isinstance(text, dict):
        q = text.get("quantization_config")
    return q if q else None


def _fp8_tensor(args: Any, what: str, strategies: tuple[str, ...], problems: list[str]) -> None:
    if not isinstance(args, dict):
        problems.append(f"{what}: {args!r}")
        return
    if args.get("type") != "float" or args.get("num_bits") != 8:
        problems.append(f"{what} type={args.get('type')} num_bits={args.get('num_bits')} (only float 8-bit)")
    if args.get("strategy") not in strategies:
        problems.append(f"{what} strategy={args.get('strategy')} (only {' | '.join(strategies)})")
    if args.get("symmetric") is False:
        problems.append(f"{what} asymmetric (zero points)")


def _compressed_tensors(q: dict[str, Any]) -> WeightQuant:
    problems: list[str] = []
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        problems.append(f"format={fmt}")
    schemes = list((q.get("config_groups") or {}).values())
    if not schemes:
        problems.append("no config_groups")
    modes = set()
    for scheme in schemes:
        _fp8_tensor(scheme.get("weights"), "weights", ("channel", "tensor"), problems)
        if (scheme.get("weights") or {}).get("dynamic"):
            problems.append("weights dynamic")
        act = scheme.get("input_activations")
        if act is None:
            modes.add(NONE)
            continue
        _fp8_tensor(act, "input_activations", ("token", "tensor"), problems)
        dynamic = act.get("dynamic", False) if isinstance(act, dict) else False
        if dynamic and act.get("strategy") != "token":
            problems.append("input_activations dynamic per tensor (only per token)")
        if not dynamic and isinstance(act, dict) and act.get("strategy") != "tensor":
            problems.append("input_activations static per token")
        modes.add(DYNAMIC if dynamic else STATIC)
        if scheme.get("output_activations") is not None:
            problems.append("output_activations")
    if len(modes) > 1:
        problems.append(f"config_groups mix activation schemes {sorted(modes)}")
    return WeightQuant("compressed-tensors", next(iter(modes), DYNAMIC), problems=problems)


def parse_weight_quant(q: dict[str, Any]) -> WeightQuant:
    """A quantization_config dict → what it asks for (problems: what llaunch does not implement)."""
    method = str(q.get("quant_method", "unknown"))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fbgemm_fp8":
        ub = q.get("activation_scale_ub")
        return WeightQuant(method, DYNAMIC, activation_scale_ub=float(ub) if ub else None)
    if method == "fp8":
        problems = []
        if q.get("weight_block_size"):
            problems.append(f"weight_block_size={q['weight_block_size']} (block-wise scales)")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            problems.append(f"activation_scheme={scheme}")
        if q.get("fmt", "e4m3") != "e4m3":
            problems.append(f"fmt={q['fmt']} (only e4m3)")
        return WeightQuant(method, STATIC if scheme == "static" else DYNAMIC, problems=problems)
    bits = q.get("bits", q.get("w_bit"))
    return WeightQuant(method, problems=[f"quant_method={method}" + (f" ({bits}-bit)" if bits else "")])


def checkpoint_weight_quant(config: dict[str, Any]) -> Optional[WeightQuant]:
    """The weight quantization config.json declares, or None for an unquantized checkpoint."""
    q = quantization_config(config)
    if q is None:
        return None
    if not isinstance(q, dict):
        return WeightQuant("unknown", problems=[f"quantization_config={q!r}"])
    return parse_weight_quant(q)
