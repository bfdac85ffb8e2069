"""Qwen3, Mistral and the MoE families at start: model=auto takes the family (and the experts) from config.json,
an unserved family or rope type exits 2 naming its key, a Qwen2.5 YaRN config is served at its stretched context,
Mistral's sliding window caps the context (or is refused beyond it), and a GGUF of a family whose GGUF tensors
llaunch does not read (Qwen3's, a Mixtral's experts) is refused."""
from __future__ import annotations

import json

import pytest

from fixtures.tiny_models import FAMILY_DIMS, TINY_DIMS
from llaunch.launcher import derive, main, rules
from unit.test_rules import assert_only


@pytest.fixture
def resolved(compose_config, tmp_path):
    """`resolved(*overrides)`: a dry run on cpu (port and machine checks skipped)."""
    return lambda *overrides: derive.resolve(compose_config("device=cpu", "dry_run=true", "server.port=0", *overrides))


def config_folder(path, model_type: str, **changes):
    """A config.json as transformers writes it for `model_type` (tiny dimensions), with `changes` on top."""
    from transformers import AutoConfig

    dims = {**TINY_DIMS, **FAMILY_DIMS.get(model_type, FAMILY_DIMS["llama"])}
    config = AutoConfig.for_model(model_type, **dims).to_dict() | changes
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_model_auto_takes_the_family_from_config_json(resolved, tmp_path, family):
    folder = config_folder(tmp_path / family, family)
    cfg = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy")
    assert cfg.model.family == family and cfg.model.name == family
    assert (cfg.model.num_attention_heads, cfg.model.head_dim) == (FAMILY_DIMS[family].get("num_attention_heads", 4),
                                                                   FAMILY_DIMS[family].get("head_dim", 16))
    assert cfg.model.max_model_len == 512 and rules.check_all(cfg) == []


@pytest.mark.parametrize("model_type", ["gemma2", "olmoe"])
def test_an_unserved_family_exits_2_naming_model_family(resolved, compose_config, tmp_path, model_type):
    folder = config_folder(tmp_path / model_type, model_type)
    overrides = ("model=auto", f"model.path={folder}", "model.load_format=dummy", "device=cpu", "dry_run=true")
    [v] = assert_only(rules.check_all(resolved(*overrides)), "family_supported")
    assert f"model.family={model_type!r}" in v.message and "qwen3" in v.message and "mixtral" in v.message
    assert main.launch(compose_config(*overrides), tmp_path / "run") == main.EXIT_INVALID


def test_an_unserved_rope_type_exits_2_naming_model_rope_scaling(resolved, compose_config, tmp_path):
    folder = config_folder(tmp_path / "ntk", "llama", rope_parameters={"rope_type": "ntk_by_parts", "factor": 4.0,
                                                                       "rope_theta": 1e4})
    overrides = ("model=auto", f"model.path={folder}", "model.load_format=dummy", "device=cpu", "dry_run=true")
    [v] = assert_only(rules.check_all(resolved(*overrides)), "rope_scaling_supported")
    assert "'ntk_by_parts' is not served" in v.message and "yarn" in v.message
    assert main.launch(compose_config(*overrides), tmp_path / "run") == main.EXIT_INVALID
    broken = config_folder(tmp_path / "yarn", "qwen2", rope_scaling={"type": "yarn", "factor": "four"})
    [v] = assert_only(rules.check_all(resolved("model=auto", f"model.path={broken}", "model.load_format=dummy")),
                      "rope_scaling_supported")
    assert "factor='four' is not a number" in v.message


def test_qwen25_yarn_is_served_at_its_stretched_context(resolved, tmp_path):
    """Qwen's documented 128k setup: rope_scaling yarn, factor 4 over original_max_position_embeddings."""
    folder = config_folder(tmp_path / "yarn", "qwen2", max_position_embeddings=512, rope_theta=1e6,
                           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    cfg = resolved("model=qwen2", f"model.path={folder}", "model.load_format=dummy")
    assert cfg.model.rope_scaling["rope_type"] == "yarn" and cfg.model.max_model_len == 2048
    assert rules.check_all(cfg) == []
    [v] = assert_only(rules.check_all(resolved("model=qwen2", f"model.path={folder}", "model.load_format=dummy",
                                               "model.max_model_len=4096")), "context_within_model")
    assert "1..2048" in v.message and "yarn" in v.message


def test_mistral_sliding_window_caps_the_context(resolved, tmp_path):
    folder = config_folder(tmp_path / "mistral", "mistral", sliding_window=256)
    cfg = resolved("model=mistral", f"model.path={folder}", "model.load_format=dummy")
    assert (cfg.model.sliding_window, cfg.model.max_model_len) == (256, 256)  # served exactly up to the window
    assert rules.check_all(cfg) == []
    [v] = assert_only(rules.check_all(resolved("model=mistral", f"model.path={folder}", "model.load_format=dummy",
                                               "model.max_model_len=512")), "context_within_sliding_window")
    assert "model.max_model_len=512" in v.message and "model.sliding_window=256" in v.message
    assert "set model.max_model_len=256" in v.message
    unwindowed = config_folder(tmp_path / "v02", "mistral", sliding_window=None)
    assert resolved("model=auto", f"model.path={unwindowed}", "model.load_format=dummy").model.max_model_len == 512


def test_a_gguf_of_a_family_whose_tensors_are_not_read_is_refused(resolved, tmp_path):
    import gguf

    path = tmp_path / "qwen3.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in dict(embedding_length=64, feed_forward_length=128, block_count=2, context_length=512,
                           vocab_size=49152).items():
        writer.add_uint32(f"qwen3.{key}", value)
    writer.add_uint32("qwen3.attention.head_count", 4)
    writer.add_uint32("qwen3.attention.head_count_kv", 2)
    writer.add_uint32("qwen3.attention.key_length", 16)
    writer.add_float32("qwen3.rope.freq_base", 1e6)
    writer.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [v] = assert_only(rules.check_all(resolved("model=auto", f"model.path={path}")), "gguf_family_served")
    assert "model.family='qwen3'" in v.message and "Hugging Face checkpoint" in v.message


@pytest.mark.parametrize("profile,family", [("qwen3-8b", "qwen3"), ("mistral-7b", "mistral"),
                                            ("qwen3-30b-a3b", "qwen3_moe"), ("mixtral-8x7b", "mixtral")])
def test_sized_profiles_plan_with_dummy_weights(resolved, profile, family):
    cfg = resolved(f"model={profile}", "model.load_format=dummy", "model.tokenizer=null", "parallel=tp2")
    assert cfg.model.family == family and rules.check_all(cfg) == []


# (config.json changes, what llaunch reads): transformers 5's Qwen3-MoE spelling (num_local_experts) and Qwen's
# releases' (num_experts); Qwen2-MoE's qkv_bias and dense layers; Mixtral's experts (its intermediate_size)
EXPERTS = [
    ("qwen3_moe", {}, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                           shared_expert_intermediate_size=0, decoder_sparse_step=1, mlp_only_layers=[],
                           attention_bias=False)),
    ("qwen3_moe", {"num_experts": 16, "num_local_experts": None}, dict(num_experts=16)),
    ("qwen2_moe", {"qkv_bias": False, "decoder_sparse_step": 2},
     dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=False,
          shared_expert_intermediate_size=96, decoder_sparse_step=2, mlp_only_layers=[0], attention_bias=False)),
    ("mixtral", {}, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                         shared_expert_intermediate_size=0, sliding_window=None)),
]


@pytest.mark.parametrize("family,changes,expected", EXPERTS)
def test_model_auto_reads_the_experts(resolved, tmp_path, family, changes, expected):
    folder = config_folder(tmp_path / family, family, **changes)
    cfg = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy", "parallel=tp2")
    assert {k: getattr(cfg.model, k) for k in expected} == expected
    assert rules.check_all(cfg) == []


def test_a_mixtral_gguf_is_refused_naming_its_experts(resolved, tmp_path):
    """Mixtral's GGUF is general.architecture llama with expert_count (and ffn_*_exps tensors llaunch does not read)."""
    import gguf

    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(embedding_length=64, feed_forward_length=128, block_count=2, context_length=512,
                           vocab_size=49152, expert_count=8, expert_used_count=2).items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_float32("llama.rope.freq_base", 1e6)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [v] = assert_only(rules.check_all(resolved("model=auto", f"model.path={path}")), "checkpoint_features_supported")
    assert "8 experts" in v.message and "Hugging Face checkpoint" in v.message
