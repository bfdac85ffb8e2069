"""Qwen2.5-VL's vision tower on a GPU at Qwen2.5-VL-7B's shape (conf/model/qwen2.5-vl-7b.yaml, random
weights): one batch of two 1,024x1,024 images and a 700x500 one (merged grids 37x37 and 18x25: windows of
4x4 merged tokens cut short at the edges), in bfloat16, against transformers' visual model on the same
weights in float32 (the truth): our error is no worse than transformers' own in bfloat16 (SDPA), and each
image's embeddings in the batch are those it gets alone, in bfloat16 and in float32. Also an 896x896 image
(whole windows only: no window needs a mask alone) batched with the 700x500 one.

In bfloat16 the 32 random blocks amplify any rounding difference to the size of bfloat16's whole error
(~2.5%), so batched-vs-alone under 1% means bit for bit (runtime/models/vision_qwen2_5.py); the printed
line shows transformers' own batched-vs-alone and whether cuBLAS rounds a row differently in a larger GEMM."""
from __future__ import annotations

import time

import torch

from gpu.conftest import REPO

GRIDS = [(1, 74, 74), (1, 74, 74), (1, 36, 50)]  # 1,036 px = 74 patches of 14; 700x500 → 504x700 px
WHOLE_WINDOWS = [(1, 64, 64), (1, 36, 50)]  # 896x896: merged 32x32, eight windows a side


def hf_tower(vision: dict, device, dtype, state: dict):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(vision_config=dict(
        depth=vision["depth"], hidden_size=vision["embed_dim"], out_hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"], hidden_act=vision["hidden_act"],
        patch_size=vision["patch_size"], spatial_merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"], window_size=vision["window_size"],
        fullatt_block_indexes=list(vision["fullatt_block_indexes"]))).vision_config
    config._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).to(device, dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model


def hf_embeddings(model, pixels: torch.Tensor, grids) -> torch.Tensor:
    with torch.inference_mode():
        out = model(pixels.to(model.dtype), grid_thw=torch.tensor(grids, device=pixels.device))
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def random_tower(arch, device, seed: int):
    from llaunch.runtime.models.vision_qwen2_5 import Qwen2_5VisionTower

    torch.manual_seed(seed)
    tower = Qwen2_5VisionTower(arch, device, torch.bfloat16).eval()
    for name, p in tower.named_parameters():
        p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.02 * torch.randn_like(p))
    return tower


def as_dtype(tower, dtype):
    from llaunch.runtime.models.vision_qwen2_5 import Qwen2_5VisionTower

    other = Qwen2_5VisionTower(tower.arch, tower.device, dtype).eval()
    other.load_state_dict({k: v.to(dtype) for k, v in tower.state_dict().items()})
    return other


def batched_vs_alone(embed, pixels: torch.Tensor, grids, truth: torch.Tensor | None = None) -> list[float]:
    """Each image's embeddings in the batch against its own alone: norms relative to its truth's (its own
    alone where no truth is given)."""
    sizes = [t * h * w for t, h, w in grids]
    batched = embed(pixels, grids).float().split([n // 4 for n in sizes])
    alone = [embed(p, [g]).float() for p, g in zip(pixels.split(sizes), grids)]
    wants = alone if truth is None else truth.split([n // 4 for n in sizes])
    return [((a - b).norm() / want.norm()).item() for a, b, want in zip(alone, batched, wants)]


def gemm_rows_differ(device, rows: int, of: int) -> float:
    """The fraction of a bfloat16 GEMM's outputs (the qkv projection's shape) that differ for the last `rows`
    rows computed alone and as the end of `of` rows."""
    torch.manual_seed(1)
    x, w = torch.randn(of, 1280, device=device).bfloat16(), (0.02 * torch.randn(3840, 1280, device=device)).bfloat16()
    return (torch.nn.functional.linear(x, w)[-rows:] != torch.nn.functional.linear(x[-rows:], w)).float().mean().item()


def windows_differ(device, arch, grids) -> float:
    """The fraction of window attention's bfloat16 outputs (PaddedWindows, one call) for the last image that
    differ between its windows alone and at the end of the batch's."""
    from llaunch.runtime.models.vision_qwen2_5 import PaddedWindows, window_order

    unit, side = arch.spatial_merge_size ** 2, arch.window_size // arch.spatial_merge_size // arch.patch_size
    lengths = [n * unit for n in window_order(grids, arch.spatial_merge_size, side)[1]]
    last = [n * unit for n in window_order(grids[-1:], arch.spatial_merge_size, side)[1]]
    torch.manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), arch.num_heads, arch.embed_dim // arch.num_heads, device=device).bfloat16()
               for _ in range(3))
    rows = sum(last)
    batched = PaddedWindows(lengths, side * side * unit, device)(q, k, v)[-rows:]
    alone = PaddedWindows(last, side * side * unit, device)(*(t[-rows:] for t in (q, k, v)))
    return (batched != alone).float().mean().item()


def timed_ms(f, *args, repeats: int = 5) -> float:
    """The median of `repeats` calls' wall times, after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        f(*args)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times[1:])[repeats // 2]


def compare(vision: dict, device, grids, seed: int = 0) -> dict:
    """Our bfloat16 error and transformers' (norms relative to transformers' float32 embeddings), and each
    image's batched-vs-alone difference: ours in bfloat16 and float32, transformers' in bfloat16."""
    from llaunch.runtime.models.vision_qwen2 import VisionArch

    arch = VisionArch.from_dict(vision)
    tower = random_tower(arch, device, seed)
    state = {k: v.float() for k, v in tower.state_dict().items()}
    width = arch.in_channels * arch.temporal_patch_size * arch.patch_size ** 2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, device=device)
    truth = hf_embeddings(hf_tower(vision, device, torch.float32, state), pixels, grids).float()
    hf16 = hf_tower(vision, device, torch.bfloat16, state)
    theirs = hf_embeddings(hf16, pixels, grids).float()
    ours = tower(pixels, grids).float()
    assert ours.shape == truth.shape
    rel = lambda x: ((x - truth).norm() / truth.norm()).item()  # noqa: E731
    return dict(ours=rel(ours), theirs=rel(theirs), batched=batched_vs_alone(tower, pixels, grids, truth),
                batched32=batched_vs_alone(as_dtype(tower, torch.float32), pixels, grids, truth),
                hf_batched=batched_vs_alone(lambda p, g: hf_embeddings(hf16, p, g), pixels, grids, truth),
                hf_ms=timed_ms(hf_embeddings, hf16, pixels, grids))


def test_qwen2_5_vl_7b_tower_matches_transformers_in_bfloat16(monkeypatch):
    import yaml

    from llaunch.runtime.models import vision_qwen2_5
    from llaunch.runtime.models.vision_qwen2 import VisionArch

    vision = yaml.safe_load((REPO / "conf" / "model" / "qwen2.5-vl-7b.yaml").read_text())["vision"]
    device = torch.device("cuda")
    m = compare(vision, device, GRIDS)
    tower = random_tower(VisionArch.from_dict(vision), device, 0)
    width = tower.patch_embed.proj.weight[0].numel()
    whole = batched_vs_alone(tower, torch.randn(sum(t * h * w for t, h, w in WHOLE_WINDOWS), width, device=device),
                             WHOLE_WINDOWS)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), width, device=device)
    ours_ms = timed_ms(tower, pixels, GRIDS)
    monkeypatch.setattr(vision_qwen2_5, "each_image", lambda f, rows, *ts: f(*ts))  # the batch's rows in one GEMM
    one_gemm_ms = timed_ms(tower, pixels, GRIDS)
    fmt = lambda xs: "[" + ", ".join(f"{x:.2e}" for x in xs) + "]"  # noqa: E731
    print(f"\nqwen2.5-vl-7b tower, bfloat16 error vs transformers' float32: ours {m['ours']:.4f}, transformers' "
          f"{m['theirs']:.4f}; batched vs alone, per image: ours bf16 {fmt(m['batched'])}, ours fp32 "
          f"{fmt(m['batched32'])}, transformers' bf16 {fmt(m['hf_batched'])}; 896x896 beside 700x500 (vs its "
          f"norm) {fmt(whole)}; bf16 qkv GEMM outputs that differ, last 1,800 rows alone vs of 12,752: "
          f"{gemm_rows_differ(device, 1800, 12752):.4f}, window attention's outputs that differ, the last image's "
          f"windows alone vs of the batch's: {windows_differ(device, tower.arch, GRIDS):.4f}; batch of 3: ours {ours_ms:.1f} ms (the batch's rows in "
          f"one GEMM: {one_gemm_ms:.1f} ms), transformers' {m['hf_ms']:.1f} ms")
    assert m["ours"] <= max(1.5 * m["theirs"], 1e-2), \
        f"relative error {m['ours']:.4f} vs transformers' bfloat16 {m['theirs']:.4f}"
    assert max(m["batched"]) < 1e-2, f"an image's embeddings change by {fmt(m['batched'])} (relative) when batched"
    assert max(m["batched32"]) < 1e-4, f"float32: an image's embeddings change by {fmt(m['batched32'])} when batched"
    assert max(whole) < 1e-2, f"an image of whole windows changes by {fmt(whole)} when batched"
