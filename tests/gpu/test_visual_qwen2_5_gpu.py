"""Qwen2.5-VL's vision tower on a GPU at Qwen2.5-VL-7B's shape (conf/model/qwen2.5-vl-7b.yaml, random
weights): one batch of two 1,024x1,024 images and a 700x500 one (merged grids 37x37 and 18x25: windows of
4x4 merged tokens cut short at the edges), in bfloat16, against transformers' visual model on the same
weights in float32 (the truth): our error is no worse than transformers' own in bfloat16 (SDPA), and each
image's embeddings in the batch are those it gets alone (the windows never mix images)."""
from __future__ import annotations

import torch

from gpu.conftest import REPO

GRIDS = [(1, 74, 74), (1, 74, 74), (1, 36, 50)]  # 1,036 px = 74 patches of 14; 700x500 → 504x700 px


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


def compare(vision: dict, device, grids, seed: int = 0) -> tuple[float, float, float]:
    """(our bfloat16 error, transformers' bfloat16 error, the last image's batched-vs-alone difference): norms
    relative to transformers' float32 embeddings (the last image's, for the third)."""
    from llaunch.runtime.models.vision_qwen2 import VisionArch
    from llaunch.runtime.models.vision_qwen2_5 import Qwen2_5VisionTower

    arch = VisionArch.from_dict(vision)
    torch.manual_seed(seed)
    tower = Qwen2_5VisionTower(arch, device, torch.bfloat16).eval()
    for name, p in tower.named_parameters():
        p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.02 * torch.randn_like(p))
    state = {k: v.float() for k, v in tower.state_dict().items()}
    width = arch.in_channels * arch.temporal_patch_size * arch.patch_size ** 2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, device=device)
    truth = hf_embeddings(hf_tower(vision, device, torch.float32, state), pixels, grids).float()
    theirs = hf_embeddings(hf_tower(vision, device, torch.bfloat16, state), pixels, grids).float()
    ours = tower(pixels, grids).float()
    assert ours.shape == truth.shape
    rel = lambda x: ((x - truth).norm() / truth.norm()).item()  # noqa: E731
    sizes = [t * h * w for t, h, w in grids]
    alone = tower(pixels[sum(sizes[:-1]):], grids[-1:]).float()
    batched = ((alone - ours[-alone.shape[0]:]).norm() / truth[-alone.shape[0]:].norm()).item()
    return rel(ours), rel(theirs), batched


def test_qwen2_5_vl_7b_tower_matches_transformers_in_bfloat16():
    import yaml

    vision = yaml.safe_load((REPO / "conf" / "model" / "qwen2.5-vl-7b.yaml").read_text())["vision"]
    ours, theirs, batched = compare(vision, torch.device("cuda"), GRIDS)
    assert ours <= max(1.5 * theirs, 1e-2), f"relative error {ours:.4f} vs transformers' bfloat16 {theirs:.4f}"
    assert batched < 1e-2, f"an image's embeddings change by {batched:.4f} (relative) when batched with others"
