"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~250 short kernels; each pays a ramp-up (its first loads in flight) and a
tail (its last programs draining) while the memory system idles. A kernel launched with PDL may be
scheduled while the previous kernel in the stream still runs; it calls `gdc_wait` before it reads
anything an earlier PDL kernel wrote and before it writes anything, so what it may do early is read
constants (the GEMVs stream their first weight tiles) and the step's inputs, which non-PDL ops
write before the first PDL kernel (decode attention reads lengths and slot indices). Every PDL
grid has programs that wait, so "the previous kernel finished" still implies "every earlier
kernel finished".

`kernels.pdl` (kernels/settings.py): `graphs` (default) uses it for launches inside `for_graphs()`
(the decode steps' CUDA-graph capture, where it was measured to pay), `all` for eager launches too,
`off` never (A/B timing); `kernels.pdl_kernels` and `kernels.pdl_late` choose the kernels and when
they trigger. The interpreter and pre-Hopper GPUs never use it.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from llaunch.kernels import settings
from llaunch.kernels.settings import Pdl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # triton's own variable: no GPU under it
_graph_work = 0  # > 0 inside for_graphs(): the launches are a capture or its warm-up
KERNELS = settings.PDL_KERNELS

# When a PDL kernel lets the next kernel launch (`gdc_launch_dependents`): EARLY at its top, or LATE
# once its own gdc_wait returned, i.e. once the kernel before it finished (kernels.pdl_late names them).
EARLY, LATE = 1, 2


def flavor(use_pdl: bool, kernel: str) -> int:
    """The PDL constexpr of a launch of `kernel`: 0 (no PDL), EARLY or LATE."""
    return (LATE if kernel in settings.current.pdl_late else EARLY) if use_pdl else 0


@functools.cache
def hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor, kernel: str) -> bool:
    """Launch `kernel` (one of KERNELS), which consumes t, with PDL?"""
    applied = settings.current
    if applied.pdl == Pdl.off or _INTERPRETED or not t.is_cuda or kernel not in applied.pdl_kernels:
        return False
    if applied.pdl == Pdl.graphs and not _graph_work:
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
