"""What a checkpoint's `quantization_config` (config.json) asks for, read as JSON without torch: the
launcher refuses at plan time what llaunch does not run (a quantized checkpoint read as if it were
not serves wrong text), and the worker builds its fp8 linear layers from the same parse.

Served: float8_e4m3fn weights with a `weight_scale` per output channel ([out, 1]) or per tensor, in
the layouts of compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC), FBGEMM (`fbgemm_fp8`) and the
plain `fp8` one (AutoFP8, vLLM's); activations quantized per token at run time, with a static
per-tensor `input_scale`, or not at all (weight-only). Block-wise weights too: one float32 scale per
block of rows × columns ([ceil(out / rows), ceil(in / columns)]), named `weight_scale_inv` in the fp8
layout (`weight_block_size`: DeepSeek-V3's and Qwen3's fp8 releases; it multiplies all the same) and
`weight_scale` in compressed-tensors' (strategy block, llm-compressor's FP8_BLOCK), with activations
quantized at run time per token per block of columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED = ("compressed-tensors float-quantized fp8 (weights e4m3 per channel, per tensor or in blocks; "
             "activations dynamic per token, static per tensor, or none; block weights: dynamic per group of a "
             "block's columns, or none), fbgemm_fp8, fp8 (weight_scale per channel or tensor with "
             "activation_scheme dynamic | static; weight_block_size [rows, columns] with activation_scheme "
             "dynamic, columns a power of two from 16)")
# activation modes of an fp8 linear layer
DYNAMIC, STATIC, NONE = "dynamic", "static", "none"


@dataclass(frozen=True)
class WeightQuant:
    """One checkpoint's weight quantization, or why llaunch cannot serve it (`problems`)."""

    method: str  # quantization_config's quant_method, as written
    activations: str = DYNAMIC  # dynamic (per-token scales) | static (the checkpoint's input_scale) | none
    activation_scale_ub: Optional[float] = None  # fbgemm_fp8: per-token absmax is clipped to this
    block: Optional[tuple[int, int]] = None  # block-wise weight scales: (rows, columns) one scale covers
    problems: list[str] = field(default_factory=list)

    @property
    def served(self) -> bool:
        return not self.problems

    @property
    def scale_name(self) -> str:
        """The tensor beside each linear's `weight` that holds its scales."""
        return "weight_scale_inv" if self.block is not None and self.method == "fp8" else "weight_scale"


def _block_size(value: Any, what: str, problems: list[str]) -> Optional[tuple[int, int]]:
    """[rows, columns] of one block's scale, or None (with a problem) where the kernels cannot take it:
    a block's columns are one tile of the block GEMM's K loop."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        problems.append(f"{what}={value!r} (two positive integers: rows, columns)")
        return None
    rows, cols = value
    if cols < 16 or cols & (cols - 1):
        problems.append(f"{what}={list(value)} (a block's columns must be a power of two, at least 16)")
        return None
    return rows, cols


def splits_blocks(runs: list[tuple[Optional[int], int]], columns: int) -> bool:
    """Whether a row-parallel layer's input columns on one rank cut the checkpoint's blocks of
    `columns`: `runs` are (first checkpoint column, or None for zero columns, count) in local order.
    A rank quantizes its activations in groups of `columns` local columns, each of which must lie in
    one block of the checkpoint (only the rank's last group may be narrower)."""
    local = 0
    for start, n in runs:
        if local % columns or (start is not None and start % columns):
            return True
        local += n
    return False


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
    modes, blocks = set(), set()
    for scheme in schemes:
        weights = scheme.get("weights")
        _fp8_tensor(weights, "weights", ("channel", "tensor", "block"), problems)
        block = None
        if isinstance(weights, dict) and weights.get("strategy") == "block":
            block = _block_size(weights.get("block_structure"), "weights block_structure", problems)
        blocks.add(block)
        if (weights or {}).get("dynamic"):
            problems.append("weights dynamic")
        if scheme.get("output_activations") is not None:
            problems.append("output_activations")
        act = scheme.get("input_activations")
        if act is None:
            modes.add(NONE)
            continue
        _fp8_tensor(act, "input_activations", ("token", "tensor", "group"), problems)
        dynamic = act.get("dynamic", False) if isinstance(act, dict) else False
        strategy = act.get("strategy") if isinstance(act, dict) else None
        if block is not None:
            if not (dynamic and strategy == "group" and act.get("group_size") == block[1]):
                problems.append(f"input_activations strategy={strategy} dynamic={dynamic} group_size="
                                f"{act.get('group_size') if isinstance(act, dict) else None} with block weights "
                                f"(only dynamic per group of the block's {block[1]} columns)")
        elif strategy == "group":
            problems.append("input_activations strategy=group without block weights")
        elif dynamic and strategy != "token":
            problems.append("input_activations dynamic per tensor (only per token)")
        elif not dynamic and isinstance(act, dict) and strategy != "tensor":
            problems.append("input_activations static per token")
        modes.add(DYNAMIC if dynamic else STATIC)
    if len(modes) > 1:
        problems.append(f"config_groups mix activation schemes {sorted(modes)}")
    if len(blocks) > 1:
        problems.append(f"config_groups mix weight blocks {sorted(blocks, key=str)}")
    return WeightQuant("compressed-tensors", next(iter(modes), DYNAMIC), block=next(iter(blocks), None),
                       problems=problems)


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
        block = None
        if q.get("weight_block_size") is not None:
            block = _block_size(q["weight_block_size"], "weight_block_size", problems)
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            problems.append(f"activation_scheme={scheme}")
        elif scheme == "static" and q.get("weight_block_size") is not None:
            problems.append("activation_scheme=static with weight_block_size (block-wise weights take activations "
                            "quantized per token per block at run time: dynamic)")
        if q.get("fmt", "e4m3") != "e4m3":
            problems.append(f"fmt={q['fmt']} (only e4m3)")
        return WeightQuant(method, STATIC if scheme == "static" else DYNAMIC, block=block, problems=problems)
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
