"""Does this GPU run the fp8 paths: e4m3 values are converted by instructions of compute capability 8.9 (Ada)
and later, which every fp8 kernel here (the GEMVs, the fp8 KV cache's store and attention, Triton's e4m3 casts)
is built on. Asked once a worker has its model, so an fp8 model or KV cache on an older GPU stops at start with
the reason, not inside a kernel's compilation mid-warm-up."""
from __future__ import annotations

from typing import Optional

from llaunch.runtime.models.fp8_linear import Fp8Layer

FP8_CAPABILITY = (8, 9)


def fp8_problem(model, fp8_kv: bool, capability: tuple[int, int], name: str = "this GPU") -> Optional[str]:
    """Why `model` (its fp8 linear layers) and an fp8 KV cache cannot run on a GPU of `capability`, or None."""
    uses = []
    if any(isinstance(m, Fp8Layer) for m in model.modules()):
        uses.append("fp8 weights (model.quantization=fp8 or an fp8 checkpoint)")
    if fp8_kv:
        uses.append("an fp8 KV cache (cache.kv_dtype=fp8_e4m3)")
    if not uses or tuple(capability) >= FP8_CAPABILITY:
        return None
    return (f"{' and '.join(uses)} need a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later "
            f"(Ada, Hopper); {name} is {capability[0]}.{capability[1]}: serve this model in bfloat16 (a checkpoint "
            "that is not fp8) and cache.kv_dtype=auto")
