"""Launch shapes of the fused MoE layer measured per GPU model (scripts/tune_moe.py), in kernels.moe_shapes' text:
the launches a layer takes on that GPU where kernels.moe_shapes does not name its shape. Keyed by
torch.cuda.get_device_name; a GPU or a layer shape not listed takes fused_moe.default_launch.

NVIDIA H200 (2026-12-04): Qwen3-30B-A3B at tp1 (128 experts of 768 columns, hidden 2,048), bf16, the whole layer
(align, both GEMMs, the sum) timed per candidate on random routing. Steps of 1-8 tokens with the pairs' GEMVs among
the candidates (312e819, the commit that added this file): 1/8/256/4 won at each, 30.1 / 47.7 / 79.0 / 130.3 µs at
1 / 2 / 4 / 8 tokens (the grouped GEMMs' best: 45.0 / 63.1 / 94.6 / 135.1). Steps of 16-2,048 tokens with the
Triton align and the grouped GEMMs as they are (49-122 candidates each; the default launch's time within 1-7%).
"""
from __future__ import annotations

MOE_SHAPES_BY_DEVICE = {
    "NVIDIA H200": ",".join([
        "128x768x2048@8=1/8/256/4/1/1",
        "128x768x2048@16=16/32/128/4/4/1",
        "128x768x2048@32=16/32/256/4/2/1",
        "128x768x2048@64=16/64/128/4/3/1",
        "128x768x2048@128=16/64/128/4/2/1",
        "128x768x2048@256=32/64/128/4/2/1",
        "128x768x2048@512=64/64/64/4/3/8",
        "128x768x2048=128/128/64/8/3/1",
    ]),
}
