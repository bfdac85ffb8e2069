"""Rope scaling as transformers computes it: the cos/sin tables row by row against transformers' rotary
embedding (decoding one token at a time, so dynamic NTK and LongRoPE grow past the trained length), and
greedy decoding of tiny checkpoints with YaRN (Qwen2.5's 4.x spelling), dynamic NTK and LongRoPE (Phi-3's
layout on a Llama, and a Phi-3 with half of each head rotary) against transformers' generate, past
original_max_position_embeddings (float32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.kernels.reference import rope_cos_sin
from llaunch.runtime.models.checkpoint import parse_hf_config
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.models.rope import context_length, normalize, rope_problems

HEAD_DIM = 16
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[1.5 + 0.4 * i for i in range(8)], original_max_position_embeddings=32)
TABLE_CASES = {
    "default": dict(rope_type="default", rope_theta=1e4),
    "linear": dict(rope_type="linear", factor=2.5, rope_theta=1e4),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=1e6),
    "yarn-mscale": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=16, rope_theta=1e4,
                        beta_fast=16, beta_slow=2, mscale=1.0, mscale_all_dim=0.5),
    "dynamic": dict(rope_type="dynamic", factor=3.7, rope_theta=1e6),
    "longrope": dict(LONGROPE, rope_theta=1e4),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=5e5),
}


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_tables_equal_transformers_rotary_embedding_token_by_token(case):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=64,
                         rope_parameters=dict(TABLE_CASES[case]))
    rotary = LlamaRotaryEmbedding(config)
    as_json = config.to_dict()
    scaling = parse_hf_config(as_json).arch.get("rope_scaling")
    assert rope_problems(scaling, HEAD_DIM) == []
    cos, sin = rope_cos_sin(HEAD_DIM, 200, as_json["rope_parameters"]["rope_theta"], scaling,
                            max_position_embeddings=64)
    for p in range(200):  # a decode step at position p: dynamic and LongRoPE change frequencies past the trained length
        want_cos, want_sin = rotary(torch.zeros(1), torch.tensor([[p]]))
        assert torch.equal(cos[p], want_cos[0, 0, : HEAD_DIM // 2]), p
        assert torch.equal(sin[p], want_sin[0, 0, : HEAD_DIM // 2]), p


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_tables_equal_transformers_phi3_longrope_token_by_token(partial):
    """Phi-3's LongRoPE, short factors up to the trained length and long ones past it, its attention factor from
    max_position_embeddings / original_max_position_embeddings, over the rotary part of each head (Phi-4-mini's
    partial_rotary_factor 0.75)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rot = int(32 * partial)
    config = Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                        original_max_position_embeddings=48, rope_parameters={
                            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": partial,
                            "short_factor": [1.0 + 0.05 * i for i in range(rot // 2)],
                            "long_factor": [1.5 + 0.3 * i for i in range(rot // 2)]})
    rotary = Phi3RotaryEmbedding(config)
    arch = parse_hf_config(config.to_dict()).arch
    assert arch.get("partial_rotary_factor", 1.0) == partial and rope_problems(arch["rope_scaling"], rot) == []
    cos, sin = rope_cos_sin(rot, 300, arch["rope_theta"], arch["rope_scaling"], max_position_embeddings=256)
    for p in range(300):
        want_cos, want_sin = rotary(torch.zeros(1), torch.tensor([[p]]))
        assert torch.equal(cos[p], want_cos[0, 0, : rot // 2]), p
        assert torch.equal(sin[p], want_sin[0, 0, : rot // 2]), p


def test_one_reader_for_both_spellings_and_phi3s_layout():
    v4 = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1e6,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    v5 = {"model_type": "qwen2", "max_position_embeddings": 32768,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768}}
    for config in (v4, v5):
        arch = parse_hf_config(config).arch
        assert arch["rope_theta"] == 1e6
        assert arch["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        assert context_length(32768, arch["rope_scaling"]) == 131072  # Qwen2.5's documented 128k
    phi3 = {"model_type": "llama", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    scaling = parse_hf_config(phi3).arch["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    assert context_length(131072, scaling) == 131072
    plain = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    arch = parse_hf_config(plain).arch
    assert "rope_scaling" not in arch and arch["head_dim"] == 128  # Qwen3Config's head_dim default
    assert rope_problems(normalize({"rope_type": "ntk_by_parts", "factor": 2.0}, {}), 16) == [
        "rope_type 'ntk_by_parts' is not served (served: default, linear, dynamic, yarn, longrope, llama3)"]
    assert "partial_rotary_factor=0.5" in " ".join(parse_hf_config({**plain, "partial_rotary_factor": 0.5}).unsupported)


def _rewrite_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def _qwen25_yarn(config):  # Qwen2.5's documented 128k setup, in transformers 4.x's spelling
    config.pop("rope_parameters")
    config["rope_theta"] = 1e6
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _phi3_longrope(config):  # Phi-3's layout: original_max_position_embeddings at the top level
    config["original_max_position_embeddings"] = 32
    config["rope_parameters"] = {**{k: v for k, v in LONGROPE.items() if k != "original_max_position_embeddings"},
                                 "rope_theta": 1e4}


def _phi3_trained_32(config):  # the tiny Phi-3's LongRoPE (half of each head rotary) trained on 32 positions
    config["original_max_position_embeddings"] = config["rope_parameters"]["original_max_position_embeddings"] = 32


# family, max_position_embeddings, config.json change, prompt length: every run decodes past position 32
GREEDY_CASES = {
    "yarn-qwen2": ("qwen2", 32, _qwen25_yarn, 40),
    "dynamic-llama": ("llama", 32, lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                         "rope_theta": 1e4}), 20),
    "longrope-llama": ("llama", 128, _phi3_longrope, 20),
}
NEW_TOKENS = 40


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """llaunch's greedy continuation of `prompt` (one prefill, then decode steps) and each step's logits."""
    tables = SlotTables(model, max_rows=1)
    logits = [model.forward(tables.batch(prefill=[(0, prompt)]), tables.kv)[-1]]
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(model.forward(tables.batch(decode=[(0, out[-1])]), tables.kv)[0])
        out.append(int(logits[-1].argmax()))
    return out, torch.stack(logits)


def transformers_greedy(folder, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """generate's greedy continuation and the logits of each of its steps (a fresh model: transformers'
    dynamic rotary keeps state between calls)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                          eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_past_the_original_context_equals_transformers(case, tmp_path):
    family, trained, change, prompt_len = GREEDY_CASES[case]
    folder = write_tiny_checkpoint(tmp_path / case, family, seed=3, max_position_embeddings=trained)
    _rewrite_config(folder, change)
    cfg = model_config_from_folder(folder, max_model_len=128)
    assert cfg.rope_scaling["rope_type"] == case.split("-")[0]
    prompt = torch.randint(3, 40000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    want, want_logits = transformers_greedy(folder, prompt, NEW_TOKENS)
    got, logits = greedy(build_model(cfg, device=torch.device("cpu"), dtype=torch.float32), prompt, NEW_TOKENS)
    assert got == want
    # every step's logits to float32 rounding (other tables, plain RoPE's or the other factors, are off 20x more)
    assert (logits - want_logits).abs().max().item() <= 1e-4 * want_logits.abs().max().item()


def test_phi3_greedy_equals_transformers_up_to_its_trained_length(tmp_path):
    """A Phi-3 (half of each head rotary, LongRoPE trained on 32 positions) decoding up to position 31: short factors,
    as transformers'. At position 32 transformers' Phi-3 generate drops its cache and prefills the whole sequence
    again with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation); llaunch rotates that position and
    the later ones with the long factors and keeps the earlier keys' rotation (as vLLM does): the tables past the
    trained length are test_tables_equal_transformers_phi3_longrope_token_by_token's."""
    folder = write_tiny_checkpoint(tmp_path / "phi3", "phi3", seed=3, max_position_embeddings=128)
    _rewrite_config(folder, _phi3_trained_32)
    cfg = model_config_from_folder(folder, max_model_len=128)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.partial_rotary_factor == 0.5
    prompt = torch.randint(3, 40000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    want, want_logits = transformers_greedy(folder, prompt, 13)  # the last step decodes position 31
    got, logits = greedy(build_model(cfg, device=torch.device("cpu"), dtype=torch.float32), prompt, 13)
    assert got == want
    assert (logits - want_logits).abs().max().item() <= 1e-4 * want_logits.abs().max().item()
