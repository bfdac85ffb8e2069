"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~250 short kernels; each pays a ramp-up (its first loads in flight) and a
tail (its last programs draining) while the memory system idles. A kernel launched with PDL may be
scheduled while the previous kernel in the stream still runs; it calls `gdc_wait` before it reads
anything an earlier PDL kernel wrote and before it writes anything, so what it may do early is read
constants (the GEMVs stream their first weight tiles) and the step's inputs, which non-PDL ops
write before the first PDL kernel (decode attention reads lengths and slot indices). Every PDL
grid has programs that wait, so "the previous kernel finished" still implies "every earlier
kernel finished".

`LLAUNCH_PDL`: `graphs` (default) uses it for launches inside `for_graphs()` (the decode steps'
CUDA-graph capture, where it was measured to pay), `all` for eager launches too, `0` never (A/B
timing). The interpreter and pre-Hopper GPUs never use it.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

MODES = ("0", "graphs", "all")
_mode = os.environ.get("LLAUNCH_PDL", "graphs")
if _mode not in MODES:
    raise ValueError(f"LLAUNCH_PDL={_mode!r}: use one of {', '.join(MODES)}")
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_graph_work = 0  # > 0 inside for_graphs(): the launches are a capture or its warm-up
# "gemv" covers the fused qkv + rotary GEMV too; "greedy" is the decode graph's closing argmax
KERNELS = ("gemv", "rmsnorm", "rotary", "decode_attention", "greedy")
# Which kernels launch with PDL (LLAUNCH_PDL_KERNELS, comma-separated): by default all of them, with
# rotary and decode attention triggering late (below). Measured on an H200 (docs/benchmarks.md, runs
# N and O): all four triggering early, 4.05 ms a step; the GEMVs and norms only, 3.81; all four with
# the two short kernels late, 3.79.
DEFAULT_KERNELS = KERNELS


def _kernel_set(names, source: str) -> frozenset:
    """names as a set of KERNELS; an unknown name is refused, naming `source` (a variable or call)."""
    names = frozenset(names)  # once: a generator would be spent by the check below
    unknown = names - set(KERNELS)
    if unknown:
        raise ValueError(f"{source}: {sorted(unknown)} unknown; kernels are {', '.join(KERNELS)}")
    return names


def _from_env(variable: str, default) -> frozenset:
    return _kernel_set((k for k in os.environ.get(variable, ",".join(default)).split(",") if k), variable)


_kernels = _from_env("LLAUNCH_PDL_KERNELS", DEFAULT_KERNELS)


# When a PDL kernel lets the next kernel launch (`gdc_launch_dependents`): EARLY at its top, or LATE
# once its own gdc_wait returned, i.e. once the kernel before it finished. With EARLY a chain of PDL
# kernels can have several grids resident and waiting at once. Measured on an H200 (docs/benchmarks.md),
# that cascade is what made PDL on decode attention cost 0.25 ms a step, while for the GEMVs it pays
# (their waiting programs have their first weight tiles in flight). LLAUNCH_PDL_LATE names the
# kernels that trigger late (comma-separated, from KERNELS); the others trigger early.
EARLY, LATE = 1, 2
DEFAULT_LATE = ("rotary", "decode_attention")
_late = _from_env("LLAUNCH_PDL_LATE", DEFAULT_LATE)


def flavor(use_pdl: bool, kernel: str) -> int:
    """The PDL constexpr of a launch of `kernel`: 0 (no PDL), EARLY or LATE."""
    return (LATE if kernel in _late else EARLY) if use_pdl else 0


def set_late(names) -> frozenset:
    """For A/B timing: these kernels trigger late (launches and captures after the call); returns the
    previous set."""
    global _late
    before, _late = _late, _kernel_set(names, "set_late")
    return before


@functools.cache
def hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor, kernel: str) -> bool:
    """Launch `kernel` (one of KERNELS), which consumes t, with PDL?"""
    if _mode == "0" or _INTERPRETED or not t.is_cuda or kernel not in _kernels:
        return False
    if _mode == "graphs" and not _graph_work:
        return False
    return hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def for_graphs():
    """Launches in this block are for CUDA graphs: wrap the warm-up with the capture, so the PDL
    variants compile in the warm-up (a constexpr) and nothing compiles while a stream captures."""
    global _graph_work
    _graph_work += 1
    try:
        yield
    finally:
        _graph_work -= 1


def set_mode(mode: str) -> str:
    """For A/B timing in one process: takes effect for launches (and graph captures) after the call.
    Returns the previous mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"PDL mode {mode!r}: use one of {', '.join(MODES)}")
    before, _mode = _mode, mode
    return before


def set_kernels(names) -> frozenset:
    """For A/B timing: only these kernels launch with PDL. Returns the previous set."""
    global _kernels
    before, _kernels = _kernels, _kernel_set(names, "set_kernels")
    return before
