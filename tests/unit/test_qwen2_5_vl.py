"""Qwen2.5-VL's vision tower (runtime/models/vision_qwen2_5.py: RMSNorm, gated SiLU MLP, window attention
with a full-attention block between windowed ones) against transformers' visual model on the same pixels,
float32: one batch of images whose merged grids are odd in a side (windows cut short at the edge), of
different sizes, and a larger one spanning several windows each way; the config.json reader's 2.5 fields."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from llaunch.runtime.config import VisualConfig
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.vision_qwen2 import VisionArch
from llaunch.runtime.models.vision_qwen2_5 import Qwen2_5VisionTower, window_order
from llaunch.runtime.models.loader import build_vision_tower
from llaunch.runtime.encoder.images import encode
from tests.fixtures.tiny_models import model_config_from_folder
from tests.fixtures.tiny_vl import image_png
from tests.fixtures.tiny_vl25 import write_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))
    cfg = replace(model_config_from_folder(path), vision=read_checkpoint(str(path)).arch["vision"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return cfg, hf, ImageInputs(cfg, VisualConfig(max_image_pixels=10**6))


def test_checkpoint_reads_the_windowed_tower(setup):
    cfg, hf, _ = setup
    v = hf.config.vision_config
    assert cfg.family == "qwen2_5_vl" and cfg.mrope_section == [2, 3, 3]
    arch = VisionArch.from_dict(cfg.vision)
    assert (arch.embed_dim, arch.hidden_size, arch.mlp_features) == (v.hidden_size, v.out_hidden_size, v.intermediate_size)
    assert (arch.window_size, arch.fullatt_block_indexes, arch.hidden_act) == (56, (1,), "silu")
    assert arch.num_params == sum(p.numel() for p in hf.model.visual.parameters())


def test_window_order_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 6, 10), (1, 8, 8), (2, 4, 6)]
    order, lengths = window_order(grids, 2, 2)
    want, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=56, patch_size=14)
    assert order.tolist() == want.tolist()
    assert np.cumsum([0] + [4 * n for n in lengths]).tolist() == cu.tolist()


@pytest.mark.parametrize("sizes", [[(90, 60), (60, 90), (120, 80)], [(250, 170)]], ids=["odd-grids", "many-windows"])
def test_tower_matches_transformers(setup, sizes):
    cfg, hf, inputs = setup
    refs = [inputs.process(image_png(w, h, seed), "image") for seed, (w, h) in enumerate(sizes)]
    grids = [tuple(r.grid) for r in refs]
    assert any((h // 2) % 2 or (w // 2) % 2 for _, h, w in grids)  # a window cut short at an edge
    tower = build_vision_tower(cfg, torch.device("cpu"), torch.float32)
    assert isinstance(tower, Qwen2_5VisionTower)
    ours = torch.cat(encode(tower, refs))
    pixels = torch.cat([torch.from_numpy(np.frombuffer(r.pixels, dtype=np.float32).copy()) for r in refs])
    with torch.inference_mode():
        want = hf.model.visual(pixels.view(ours.shape[0] * 4, -1), grid_thw=torch.tensor(grids)).pooler_output
    assert ours.abs().max() > 0.1  # embeddings that carry the image
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


# Qwen2.5-VL-7B-Instruct's config.json as transformers 4.x wrote it: the language model's keys at the top,
# rope_scaling (type mrope), the vision tower's in_chans
CONFIG_4X = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 128000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645, "image_token_id": 151655,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "video_token_id": 151656,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}


def test_transformers_4x_config_reads_as_the_7b_profile():
    import yaml

    from llaunch.runtime.models.checkpoint import parse_hf_config
    from tests.fixtures.tiny_models import REPO

    ckpt = parse_hf_config(CONFIG_4X)
    profile = yaml.safe_load((REPO / "conf" / "model" / "qwen2.5-vl-7b.yaml").read_text())
    assert ckpt.family == profile["family"] == "qwen2_5_vl"
    assert ckpt.arch["vision"] == profile["vision"]
    for key in ("hidden_size", "num_hidden_layers", "max_position_embeddings", "mrope_section", "attention_bias"):
        assert ckpt.arch[key] == profile[key], key
    assert ckpt.arch.get("rope_scaling") is None  # M-RoPE, not a scaling


# merged grids 3x5 (windows cut both ways), 4x4 (whole windows only), 1x1 (less than a window), two frames of
# 2x3, 5x2; windows of 2x2 merged tokens (16 patches)
AWKWARD = [(1, 6, 10), (1, 8, 8), (1, 2, 2), (2, 4, 6), (1, 10, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_image_encodes_the_same_alone_and_in_any_batch(dtype):
    """Bit for bit, whatever it is batched with: in bfloat16 the 7B tower's 32 blocks amplify any rounding
    difference to ~2.5% of the embeddings. On a GPU a GEMM's rounding may depend on its row count (cuBLAS picks
    its kernel by shape), which this CPU cannot show: every linear sees one image's rows."""
    arch = VisionArch(depth=4, embed_dim=32, hidden_size=24, num_heads=2, mlp_ratio=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu", intermediate_size=48,
                      window_size=56, fullatt_block_indexes=(1,))
    torch.manual_seed(0)
    tower = Qwen2_5VisionTower(arch, "cpu", dtype).eval()
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.2 * torch.randn_like(p))
    pixels = [torch.randn(t * h * w, 3 * 2 * 14 * 14) for t, h, w in AWKWARD]
    rows = []
    for m in tower.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    batched = tower(torch.cat(pixels), AWKWARD).split([t * h * w // 4 for t, h, w in AWKWARD])
    assert set(rows) == {t * h * w // d for t, h, w in AWKWARD for d in (1, 4)}  # patches, merged tokens
    backwards = tower(torch.cat(pixels[::-1]), AWKWARD[::-1]).split([t * h * w // 4 for t, h, w in AWKWARD[::-1]])
    for image, grid, out, out_backwards in zip(pixels, AWKWARD, batched, backwards[::-1]):
        alone = tower(image, [grid])
        assert alone.abs().max() > 0.1
        assert torch.equal(out, alone) and torch.equal(out_backwards, alone), grid
