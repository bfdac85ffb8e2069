"""Gemma 2/3 and Phi-3 checkpoints in every layout transformers writes for them load and decode as transformers'
generate does (float32, CPU). Observed under 5.24: Gemma2ForCausalLM, Gemma3ForCausalLM and Phi3ForCausalLM save
model.* (tied Gemmas without lm_head.weight; Phi-3's qkv_proj and gate_up_proj fused); Gemma3ForConditionalGeneration
saves its text model as language_model.model.* beside vision_tower.* and multi_modal_projector.* (its own module
names, model.language_model.*, where the renaming back is skipped); a base model saved alone (Gemma2Model,
Gemma3TextModel, Phi3Model) has embed_tokens.*, layers.*, norm.*. The multimodal checkpoint is served as its text
model (the vision tower is not loaded)."""
from __future__ import annotations

import json

import pytest
import torch

from fixtures.tiny_models import FAMILY_DIMS, TINY_DIMS, model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.models.loader import build_model
from unit.test_checkpoint_layouts import BASE_MODEL_ALONE, renamed, resave, tensor_names
from unit.test_rope_scaling import greedy

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

NEW_TOKENS = 12
PROMPT = torch.randint(3, 40000, (17,), generator=torch.Generator().manual_seed(4)).tolist()  # windows 5, 6, 12 < 17
GEMMA3_OWN_NAMES = renamed(("model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                           ("multi_modal_projector.", "model.multi_modal_projector."))  # from our names


def transformers_greedy(model) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(PROMPT):].tolist(), torch.cat(out.logits).float()


def assert_decodes_as(folder, want):
    tokens, want_logits = want
    got, logits = greedy(build_model(model_config_from_folder(folder), device=torch.device("cpu"),
                                     dtype=torch.float32), PROMPT, NEW_TOKENS)
    assert got == tokens
    assert (logits - want_logits).abs().max().item() <= 1e-4 * max(1.0, want_logits.abs().max().item())


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) around the tiny Gemma 3 text model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(**{**TINY_DIMS, **FAMILY_DIMS["gemma3_text"]})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=49000, boi_token_index=48998, eoi_token_index=48999)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # (1 + w) norms drawn around w = 0, as the tiny fixtures' Gemmas
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.copy_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(path)
    return path, transformers_greedy(model)


def test_gemma3_multimodal_checkpoint_is_served_as_its_text_model(gemma3_multimodal):
    path, want = gemma3_multimodal
    names = tensor_names(path)
    assert "language_model.model.embed_tokens.weight" in names and any(n.startswith("vision_tower.") for n in names)
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma3"
    cfg = model_config_from_folder(path)
    assert cfg.family == "gemma3_text" and cfg.rope_local_base_freq == 100.0 and cfg.sliding_window == 5
    assert_decodes_as(path, want)


def test_gemma3_multimodal_under_transformers_own_names(gemma3_multimodal, tmp_path):
    path, want = gemma3_multimodal
    folder = resave(path, tmp_path / "own", GEMMA3_OWN_NAMES, files=2)
    assert "model.language_model.embed_tokens.weight" in tensor_names(folder)
    assert_decodes_as(folder, want)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"])
def test_causal_lm_and_base_model_saved_alone(tmp_path, family):
    from transformers import AutoModelForCausalLM

    path = write_tiny_checkpoint(tmp_path / family, family, tie_word_embeddings=True)
    names = tensor_names(path)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert ("model.layers.0.self_attn.qkv_proj.weight" in names) == (family == "phi3")
    want = transformers_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    assert_decodes_as(path, want)
    alone = resave(path, tmp_path / "alone", BASE_MODEL_ALONE)
    assert "embed_tokens.weight" in tensor_names(alone)
    assert_decodes_as(alone, want)

