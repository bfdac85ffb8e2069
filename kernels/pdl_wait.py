"""The device side of programmatic dependent launch (kernels/pdl.py), one helper for every kernel:
kernels/pdl.py stays importable without triton (the worker imports it on CPU-only installs)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Return once the previous kernel in the stream has finished and its writes are visible. PDL is
    pdl.flavor()'s constexpr: 0 no PDL (nothing to wait for), 1 (EARLY) the next kernel may launch
    from now on, 2 (LATE) only once this wait returned."""
    if PDL:
        if PDL == 1:
            gdc_launch_dependents()
        gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()
