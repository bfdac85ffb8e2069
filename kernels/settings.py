"""Kernel choices and launch tuning: the `kernels` config group (runtime/config.py names this class
as its schema), applied once per worker process by `configure`. No torch or triton here: the
launcher validates these settings when it checks a config.

Every switch changes which kernels run or how they launch, never what they compute beyond bf16
rounding: `backend` and `gemv` change the summation order; the PDL keys only timing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, NamedTuple, Optional


class Backend(str, Enum):
    triton = "triton"  # Triton kernels for CUDA tensors, torch references on CPU
    reference = "reference"  # the plain-torch references everywhere (debugging, A/B timing)


class Gemv(str, Enum):
    triton = "triton"  # one-row (batch-1 decode) linear layers through kernels/gemv.py
    cublas = "cublas"  # through torch (cuBLAS), as wider batches are


class Fp8Gemm(str, Enum):
    rowwise = "rowwise"  # cuBLASLt's fp8 GEMM with the token (row) and channel scales in it
    tensor_epilogue = "tensor_epilogue"  # its per-tensor GEMM with unit scales, the scales in a Triton epilogue


class Pdl(str, Enum):
    off = "off"
    graphs = "graphs"  # inside the decode graphs' capture, where it was measured to pay
    all = "all"  # eager launches too


# Kernels that may launch with programmatic dependent launch (kernels/pdl.py); "gemv" covers the
# staged LM head too, "greedy" is the decode graph's closing argmax, "moe" a decode step's routing and its
# experts' GEMVs (kernels/fused_moe.py: the steps of few pairs).
PDL_KERNELS = ("gemv", "rmsnorm", "rotary", "decode_attention", "greedy", "moe")
MAX_TMA_BOX = 256  # elements per dimension of one TMA copy (the staged GEMV's tile bound)
# kernels.row_invariant's small steps: up to this many tokens (every CUDA-graph bucket set holds 16, so such a step is
# never padded past it; the worker runs a smaller one unpadded where its graph would pad it more: to 64 tokens)
INVARIANT_ROWS = 16


class MoeLaunch(NamedTuple):
    """How kernels/fused_moe.py launches both grouped GEMMs of an MoE layer: tiles of BLOCK_M (token, expert) pairs
    of one expert × BLOCK_N output columns, BLOCK_K inputs a step; GROUP_M row tiles share a column of weight tiles."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8


# {(experts on the rank, intermediate columns on the rank, hidden): [(most tokens of a step or None, launch)]}
MoeShapes = dict[tuple[int, int, int], list[tuple[Optional[int], MoeLaunch]]]


@dataclass(frozen=True)
class KernelSettings:
    backend: Backend = Backend.triton  # triton kernels, or the plain-torch references everywhere
    gemv: Gemv = Gemv.triton  # batch-1 decode linear layers: the Triton GEMV or cuBLAS
    # Launch shapes per weight shape, overriding kernels/gemv.py's built-in ones: comma-separated
    # `NxK[:gated][:fp8]=BLOCK_N/BLOCK_K/WARPS[/STAGES[/SPLIT]]` (N output rows, K inputs; `:fp8` for e4m3 weights,
    # model.quantization=fp8, whose shapes are their own; STAGES ≥ 2 runs the TMA-staged kernel, for fp8
    # weights the tensor-core one; 0 on the LM head's shape keeps it on cuBLAS; SPLIT, fp8 tensor-core shapes
    # of ungated layers only: K over that many programs an output tile). Sweep candidates with
    # `llaunch -m bench=c1 kernels.gemv_shapes=...` on the GPU they are for.
    gemv_shapes: str = ""
    # Launch shapes of the fused MoE layer's grouped GEMMs (kernels/fused_moe.py) per layer shape, overriding its
    # defaults: comma-separated `ExIxH[@TOKENS]=BLOCK_M/BLOCK_N/BLOCK_K/WARPS/STAGES[/GROUP_M]` (E experts and I
    # intermediate columns on one rank, H hidden; @TOKENS: for steps of at most that many tokens, the smallest bound
    # that holds winning, none: any step; BLOCK_M 1: each (token, expert) pair as two GEMVs of BLOCK_N rows a
    # program, STAGES and GROUP_M unused). A shape not named takes the launches measured on the GPU model
    # (kernels/moe_launches.py), else the defaults. Tune with scripts/tune_moe.py on the GPU they are for.
    moe_shapes: str = ""
    # fp8 layers' GEMMs of two or more rows (kernels/fp8_epilogue.py): cuBLASLt's per-tensor GEMM with unit scales
    # writing bfloat16 sums and the row × channel scales (and bias) applied by one kernel after it (one rounding
    # more), or the row-wise scaled GEMM. On an H200 (CUDA graphs, Qwen2-7B's four linears a layer) the first took
    # 83-130 µs at 16-256 rows against 122-166 (scripts/bench_fp8_gemm.py); served at c64, 1.29× bf16 against the
    # row-wise GEMM's 1.12× (docs/performance.md). Whole steps of 512-2,010 rows (H100, the fused MLP) too: 9.30 vs
    # 9.88 ms, 16.56 vs 17.34, 32.09 vs 37.60 (scripts/profile_kernels.py --set fp8_gemm=...), though
    # scripts/bench_fp8_gemm.py timed the row-wise GEMM alone 4-9% faster there (an `auto` that took it from 512
    # rows lost; 2026-12-05)
    fp8_gemm: Fp8Gemm = Fp8Gemm.tensor_epilogue
    # An fp8 MLP of two or more rows whose down_proj quantizes its input per token (dynamic or static): gate‖up's
    # sums → scales → act · up → down_proj's e4m3 values in one kernel (kernels/fp8_gated_quant.py) instead of three
    # (the epilogue, the activation, the quantization; in a c256-like 35 ms mixed step on an H100 the epilogues and
    # quantizations of all four linears took 6.6 ms, the activation 2.3)
    fp8_fused_mlp: bool = True
    # An fp8 layer of two or more rows that quantizes its input per token (qkv, gate‖up) takes it from the RMSNorm
    # before it: the norm's kernel writes the e4m3 values and the row's scale (kernels/rmsnorm.rmsnorm_quantized, the
    # bytes kernels/fp8_rows.py makes of its 16-bit output) instead of the 16-bit row, and the quantizing kernel goes
    # (in a c256-like 32 ms mixed step on an H100 those quantizations took 1.02 ms)
    fp8_fused_norm: bool = True
    # An fp8 o_proj or down_proj of two or more rows (kernels.fp8_gemm=tensor_epilogue, no bias, one rank) hands the
    # RMSNorm after it its GEMM's unscaled sums and their scales, and q‖k‖v hands its sums to the rotary kernel (a
    # cache of the model's dtype): those kernels scale them as they read them (the epilogue's roundings), and the
    # epilogue kernel with its write and read of the layer's output goes (the epilogues of q‖k‖v, o_proj and down_proj
    # took 0.76 ms of a c256-like 30.46 ms step on an H100). Not for float32 models (the epilogue's FMA) nor where
    # another kernel follows: Gemma's sandwich norms, q / k head norms (Qwen3), partial rotary, an fp8 KV cache
    fp8_norm_epilogue: bool = True
    # Linear layers of 2 to this many rows (≤ 16: verify steps of speculative decoding, small decode batches) on the
    # tensor cores in one pass over the weights (kernels/skinny_gemm.py) instead of cuBLAS; 0: cuBLAS. On an H200
    # (Qwen2-7B shape, graphs, context 1,024) a verify step of k = 1-4 took 1.12-1.14 decode steps so against cuBLAS's
    # 1.21-1.22 (scripts/bench_steps.py --verify --skinny-rows 16, docs/performance.md)
    skinny_rows: int = 16
    # Its launch shapes per weight shape, overriding the built-in ones: comma-separated
    # `NxK[:gated]=BLOCK_N/BLOCK_K/WARPS/STAGES[/SPLIT]` (SPLIT: K over that many programs a tile, ungated layers)
    skinny_shapes: str = ""
    # Weight shapes `NxK[:gated]` whose one-row products (batch-1 decode) run that kernel too, not the GEMV
    # (kernels/gemv.py); sweep with scripts/bench_decode_shapes.py --skinny
    skinny_one_row: List[str] = field(default_factory=list)
    # Weight shapes `NxK[:gated]` of e4m3 layers whose one-row products on the tensor cores (kernels/gemv_fp8.py: a
    # kernels.gemv_shapes STAGES ≥ 2) take the weight tile as the MMA's A operand and x as B (swap AB), not x as A;
    # compare with scripts/bench_decode_shapes.py --fp8 --tensor-core --swap-ab
    fp8_swap_ab: List[str] = field(default_factory=list)
    # e4m3 layers' one-row products on the register kernel (kernels/gemv.py, a launch shape with STAGES 0) read their
    # weights as 32-bit words, two weights a float16 FMA (kernels/e4m3_words.py), where x is quantized (dynamic or
    # static activations) and the model bfloat16; off: each weight converted to float32 (row_dots). H100, Qwen2-7B's
    # batch-1 fp8 step (6f85a72): qkv 1.70 -> 1.94 TB/s, o_proj 1.56 -> 1.66, the step 3.397 -> 3.327 ms
    fp8_words: bool = True
    # Each row of a step of up to 16 tokens (INVARIANT_ROWS) summed alike whatever the step's other rows: a 16-bit
    # layer's rows each on the GEMV's own programs (kernels/gemv.py's row grid: the one-row code, so a row of a verify
    # step gets a decode row's bits; the LM head too), decode attention split as for one row of the longest context
    # the KV rows hold. Speculative decoding then gives a bfloat16 model's spec-off text (a verify row on the skinny
    # GEMM and a decode row on the GEMV otherwise round differently); off: verify rows on the skinny GEMM. 16-bit
    # dense models on one rank only (launcher/rules.py: row_invariant_covers_model)
    row_invariant: bool = False
    pdl: Pdl = Pdl.graphs  # programmatic dependent launch: off, in decode graphs, or everywhere
    # Which kernels launch with PDL (default all), and which of them let the next kernel launch only
    # after their own wait (late) instead of at their top: early triggering cascades resident grids,
    # which cost decode attention 0.25 ms a step on an H200, while the GEMVs gain from it.
    pdl_kernels: List[str] = field(default_factory=lambda: list(PDL_KERNELS))
    pdl_late: List[str] = field(default_factory=lambda: ["rotary", "decode_attention"])  # trigger after the wait

    def problems(self) -> list[tuple[str, str]]:
        """(key, message) for every invalid value; empty when the settings can be applied."""
        found = []
        for key in ("pdl_kernels", "pdl_late"):
            unknown = sorted(set(getattr(self, key)) - set(PDL_KERNELS))
            if unknown:
                found.append((f"kernels.{key}", f"kernels.{key}: {unknown} unknown; kernels are {', '.join(PDL_KERNELS)}"))
        if not 0 <= self.skinny_rows <= 16:
            found.append(("kernels.skinny_rows", f"kernels.skinny_rows: {self.skinny_rows} is not 0 (off) to 16 (an "
                                                 "MMA's rows)"))
        if self.row_invariant and Gemv(self.gemv) != Gemv.triton:
            found.append(("kernels.row_invariant", "kernels.row_invariant needs kernels.gemv=triton (the GEMV whose "
                                                   "one-row code it runs every row of a small step on)"))
        if self.row_invariant and self.skinny_one_row:
            found.append(("kernels.skinny_one_row", f"kernels.skinny_one_row={self.skinny_one_row} sends one-row "
                          "products to the tensor cores, and kernels.row_invariant keeps every row of a small step on "
                          "the GEMV: unset one of them"))
        for key, parse in (("gemv_shapes", parse_gemv_shapes), ("moe_shapes", parse_moe_shapes),
                           ("skinny_shapes", parse_skinny_shapes), ("skinny_one_row", parse_weight_shapes),
                           ("fp8_swap_ab", parse_weight_shapes)):
            try:
                parse(getattr(self, key), key) if parse is parse_weight_shapes else parse(getattr(self, key))
            except ValueError as e:
                found.append((f"kernels.{key}", str(e)))
        return found


def parse_gemv_shapes(text: str) -> dict[tuple[int, int, bool, bool], tuple[int, int, int, int, int]]:
    """`gemv_shapes` as {(N, K, gated, fp8): (BLOCK_N, BLOCK_K, WARPS, STAGES, SPLIT)}; SPLIT (default 1): K over
    that many programs a tile, for an ungated e4m3 layer: the tensor-core kernel (kernels/gemv_fp8.py) or the
    register kernel where it reads the weights as words (kernels.fp8_words; else it takes all of K a program)."""
    shapes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            key, value = item.split("=")
            dims, _, kind = key.partition(":")
            fp8 = kind in ("fp8", "gated:fp8")
            kind = kind.removesuffix("fp8").rstrip(":") if fp8 else kind
            n, k = (int(v) for v in dims.split("x"))
            values = [int(v) for v in value.split("/")]
            if len(values) not in (3, 4, 5):
                raise ValueError
            block_n, block_k, warps, stages, split = [*values, *(0, 1)[len(values) - 3:]]
        except ValueError:
            raise ValueError(f"kernels.gemv_shapes: {item!r} is not "
                             "NxK[:gated][:fp8]=BLOCK_N/BLOCK_K/WARPS[/STAGES[/SPLIT]]") from None
        powers = all(v > 0 and v & (v - 1) == 0 for v in (block_n, block_k, warps))
        if kind not in ("", "gated") or not powers or warps > 16:
            raise ValueError(f"kernels.gemv_shapes: {item!r}: blocks and warps must be powers of two (warps ≤ 16), "
                             "the suffixes are ':gated' and ':fp8'")
        if stages and (stages < 2 or max(block_n, block_k) > MAX_TMA_BOX or block_k < 16):
            raise ValueError(f"kernels.gemv_shapes: {item!r}: STAGES is 0 or ≥ 2, and the staged kernel (≥ 2) "
                             f"takes blocks of at most {MAX_TMA_BOX} (a TMA box) and BLOCK_K ≥ 16 (16-byte rows)")
        if split != 1 and (split < 1 or not fp8 or kind == "gated"):
            raise ValueError(f"kernels.gemv_shapes: {item!r}: SPLIT (≥ 1) is for an ungated e4m3 layer (the "
                             "tensor-core kernel, STAGES ≥ 2, or the register kernel reading words): an ':fp8' key "
                             "without ':gated'")
        shapes[(n, k, kind == "gated", fp8)] = (block_n, block_k, warps, stages, split)
    return shapes


def parse_skinny_shapes(text: str) -> dict[tuple[int, int, bool], tuple[int, int, int, int, int]]:
    """`skinny_shapes` as {(N, K, gated): (BLOCK_N, BLOCK_K, WARPS, STAGES, SPLIT)}; SPLIT defaults to 1."""
    shapes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            key, value = item.split("=")
            dims, _, kind = key.partition(":")
            n, k = (int(v) for v in dims.split("x"))
            values = [int(v) for v in value.split("/")]
            if len(values) not in (4, 5) or kind not in ("", "gated"):
                raise ValueError
            block_n, block_k, warps, stages, split = [*values, 1][:5]
        except ValueError:
            raise ValueError(f"kernels.skinny_shapes: {item!r} is not NxK[:gated]=BLOCK_N/BLOCK_K/WARPS/STAGES[/SPLIT]") \
                from None
        powers = all(v > 0 and v & (v - 1) == 0 for v in (block_n, block_k, warps))
        if not powers or min(block_n, block_k) < 16 or warps > 16 or stages < 1 or split < 1 or (kind and split > 1):
            raise ValueError(f"kernels.skinny_shapes: {item!r}: blocks are powers of two of at least 16 (an MMA's), "
                             "warps a power of two up to 16, STAGES and SPLIT at least 1, SPLIT 1 on a ':gated' shape")
        shapes[(n, k, kind == "gated")] = (block_n, block_k, warps, stages, split)
    return shapes


def parse_weight_shapes(names: List[str], key: str = "skinny_one_row") -> frozenset[tuple[int, int, bool]]:
    """A list of weight shapes (`skinny_one_row`, `fp8_swap_ab`: the key, for messages) as {(N, K, gated)}."""
    shapes = set()
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"kernels.{key}: {name!r} is not a weight shape NxK[:gated]")
        dims, _, kind = name.strip().partition(":")
        try:
            n, k = (int(v) for v in dims.split("x"))
        except ValueError:
            n = k = 0
        if min(n, k) < 1 or kind not in ("", "gated"):
            raise ValueError(f"kernels.{key}: {name!r} is not a weight shape NxK[:gated]")
        shapes.add((n, k, kind == "gated"))
    return frozenset(shapes)


def parse_moe_shapes(text: str) -> MoeShapes:
    """`moe_shapes` as {(E, I, H): [(max tokens or None, MoeLaunch)]}, each list's bounds ascending, None last."""
    shapes: MoeShapes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            key, value = item.split("=")
            dims, _, tokens = key.partition("@")
            e, i, h = (int(v) for v in dims.split("x"))
            values = [int(v) for v in value.split("/")]
            if len(values) not in (5, 6) or min(e, i, h) < 1 or (tokens and int(tokens) < 1):
                raise ValueError
            launch = MoeLaunch(*values)
        except ValueError:
            raise ValueError(f"kernels.moe_shapes: {item!r} is not ExIxH[@TOKENS]=BLOCK_M/BLOCK_N/BLOCK_K/WARPS/STAGES"
                             "[/GROUP_M] (positive integers)") from None
        powers = all(v > 0 and v & (v - 1) == 0 for v in (launch.block_m, launch.block_n, launch.block_k, launch.warps))
        if launch.block_m == 1:  # the per-pair GEMVs: BLOCK_N output rows a program, K walked BLOCK_K at a time
            small = launch.block_k < 16
        else:
            small = min(launch.block_m, launch.block_n, launch.block_k) < 16
        if not powers or small or launch.warps > 16 or launch.stages < 1 or launch.group_m < 1:
            raise ValueError(f"kernels.moe_shapes: {item!r}: blocks are powers of two of at least 16 (tl.dot's "
                             "smallest; BLOCK_M 1 runs each pair as GEMVs, any BLOCK_N), warps a power of two up to "
                             "16, STAGES and GROUP_M at least 1")
        shapes.setdefault((e, i, h), []).append((int(tokens) if tokens else None, launch))
    for launches in shapes.values():
        launches.sort(key=lambda bound: (bound[0] is None, bound[0] or 0))
    return shapes


class _Applied:
    """The settings in force in this process, with what the launches read parsed once."""

    def __init__(self, settings: KernelSettings):
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(message for _, message in problems))
        self.settings = settings
        self.reference = Backend(settings.backend) == Backend.reference
        self.triton_gemv = Gemv(settings.gemv) == Gemv.triton
        # fp8 GEMMs of 2+ rows: the per-tensor GEMM with the scales in the epilogue kernel, or the row-wise one
        self.fp8_epilogue = Fp8Gemm(settings.fp8_gemm) == Fp8Gemm.tensor_epilogue
        self.fp8_fused_mlp = bool(settings.fp8_fused_mlp)
        self.fp8_fused_norm = bool(settings.fp8_fused_norm)
        self.fp8_norm_epilogue = bool(settings.fp8_norm_epilogue)
        self.gemv_shapes = parse_gemv_shapes(settings.gemv_shapes)
        self.moe_shapes = parse_moe_shapes(settings.moe_shapes)
        self.skinny_shapes = parse_skinny_shapes(settings.skinny_shapes)
        self.skinny_one_row = parse_weight_shapes(settings.skinny_one_row)
        self.fp8_swap_ab = parse_weight_shapes(settings.fp8_swap_ab, "fp8_swap_ab")
        self.fp8_words = bool(settings.fp8_words)
        self.row_invariant = bool(settings.row_invariant)
        self.pdl = Pdl(settings.pdl)
        self.pdl_kernels = frozenset(settings.pdl_kernels)
        self.pdl_late = frozenset(settings.pdl_late)


current = _Applied(KernelSettings())


def configure(settings: KernelSettings) -> KernelSettings:
    """Apply `settings` to launches (and graph captures) from now on; returns the previous ones."""
    global current
    before, current = current.settings, _Applied(settings)
    return before


def invariant_step(tokens: int) -> bool:
    """Does a step of `tokens` rows keep each row's sums alike (kernels.row_invariant, up to INVARIANT_ROWS)?"""
    return current.row_invariant and 1 <= tokens <= INVARIANT_ROWS
