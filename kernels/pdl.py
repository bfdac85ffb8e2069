"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~250 short kernels; each pays a ramp-up (its first loads in flight) and a
tail (its last programs draining) while the memory system idles. A kernel launched with PDL may be
scheduled while the previous kernel in the stream still runs; it calls `gdc_wait` before it reads
anything an earlier kernel wrote and before it writes anything, so what it may do early is read
constants (the GEMV streams its first weight tiles). Every PDL kernel waits unconditionally, so
"the previous kernel finished" still implies "every earlier kernel finished".

`LLAUNCH_PDL=0` turns it off (A/B timing); the interpreter and pre-Hopper GPUs never use it.
"""
from __future__ import annotations

import functools
import os

import torch

_enabled = os.environ.get("LLAUNCH_PDL", "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Launch the kernels that produce/consume t with PDL?"""
    return _enabled and t.is_cuda and _hopper_or_later(t.device.index if t.device.index is not None
                                                       else torch.cuda.current_device())


def set_enabled(flag: bool) -> bool:
    """For A/B timing in one process; takes effect for launches (and graph captures) after the call.
    Returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, flag and os.environ.get("TRITON_INTERPRET") != "1"
    return before


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords: the interpreter's launcher does not take `launch_pdl`."""
    return {"launch_pdl": True} if pdl else {}
