"""Qwen3, Mistral, Gemma 2/3, Phi-3 and the MoE families at start: model=auto takes the family (and the experts, the
windows, Gemma's and Phi-3's variants) from config.json in each spelling transformers and the model's authors have
written, an unserved family, rope type or feature exits 2 naming its key, a Qwen2.5 YaRN config is served at its
stretched context, a sliding window no longer caps the context, and a GGUF of a family whose GGUF tensors llaunch
does not read (Qwen3's, a Mixtral's experts) is refused."""
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


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2",
                                    "gemma3_text", "phi3"])
def test_model_auto_takes_the_family_from_config_json(resolved, tmp_path, family):
    folder = config_folder(tmp_path / family, family)
    cfg = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy")
    assert cfg.model.family == family and cfg.model.name == family
    assert (cfg.model.num_attention_heads, cfg.model.head_dim) == (FAMILY_DIMS[family].get("num_attention_heads", 4),
                                                                   FAMILY_DIMS[family].get("head_dim", 16))
    assert cfg.model.max_model_len == 512 and rules.check_all(cfg) == []


@pytest.mark.parametrize("model_type", ["gemma", "olmoe"])
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


def test_mistral_sliding_window_no_longer_caps_the_context(resolved, tmp_path):
    """The attention kernels honour the window: Mistral 7B v0.1's 4096 in a 32k context is served at 32k."""
    folder = config_folder(tmp_path / "mistral", "mistral", sliding_window=256)
    cfg = resolved("model=mistral", f"model.path={folder}", "model.load_format=dummy")
    assert (cfg.model.sliding_window, cfg.model.max_model_len) == (256, 512)
    assert rules.check_all(cfg) == []
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
                                            ("qwen3-30b-a3b", "qwen3_moe"), ("mixtral-8x7b", "mixtral"),
                                            ("gemma3-12b", "gemma3_text"), ("phi4", "phi3")])
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


# Google's gemma-3-12b-it config.json: a Gemma3ForConditionalGeneration whose text_config gives only these keys
GEMMA3_12B_TEXT = {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                   "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}


def raw_folder(path, config: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_gemma3_release_config_takes_gemma3s_defaults(resolved, tmp_path):
    """The text_config Google wrote leaves head_dim, the vocabulary, the rotary bases, the pattern and the scale to
    Gemma3TextConfig; its linear x 8 does not stretch the context again (131,072 is the scaled one)."""
    folder = raw_folder(tmp_path / "gemma-3-12b-it", {"model_type": "gemma3", "text_config": GEMMA3_12B_TEXT,
                                                      "vision_config": {"model_type": "siglip_vision_model"},
                                                      "eos_token_id": [1, 106]})
    m = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy").model
    assert (m.family, m.head_dim, m.vocab_size, m.max_model_len, m.eos_token_ids) == ("gemma3_text", 256, 262208,
                                                                                      131072, [1, 106])
    assert (m.rope_theta, m.rope_local_base_freq, m.rope_scaling["rope_type"]) == (1e6, 1e4, "linear")
    assert m.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 8 and m.sliding_window == 1024
    assert (m.hidden_act, m.query_pre_attn_scalar, m.tie_word_embeddings) == ("gelu_pytorch_tanh", 256, True)
    assert m.attn_logit_softcapping is None and m.final_logit_softcapping is None
    assert rules.check_all(resolved("model=auto", f"model.path={folder}", "model.load_format=dummy",
                                    "model.tokenizer=null")) == []
    profile = resolved("model=gemma3-12b", "model.load_format=dummy", "model.tokenizer=null").model
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "vocab_size", "rope_theta", "rope_local_base_freq",
                "sliding_window", "query_pre_attn_scalar", "max_model_len"):
        assert getattr(profile, key) == getattr(m, key), key


def test_gemma_configs_of_transformers_4(resolved, tmp_path):
    """4.x spellings: Gemma 3's rope_theta / rope_local_base_freq / sliding_window_pattern beside rope_scaling (4.50);
    Gemma 2 before layer_types (alternating, local first)."""
    gemma3 = raw_folder(tmp_path / "g3", {**GEMMA3_12B_TEXT, "num_hidden_layers": 4, "rope_theta": 5e5,
                                          "rope_local_base_freq": 2e4, "sliding_window_pattern": 2})
    m = resolved("model=gemma3", f"model.path={gemma3}", "model.load_format=dummy").model
    assert (m.rope_theta, m.rope_local_base_freq) == (5e5, 2e4)
    assert m.layer_types == ["sliding_attention", "full_attention"] * 2
    gemma2 = raw_folder(tmp_path / "g2", {"model_type": "gemma2", "num_hidden_layers": 3, "hidden_size": 64,
                                          "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 512})
    m = resolved("model=auto", f"model.path={gemma2}", "model.load_format=dummy").model
    assert m.layer_types == ["sliding_attention", "full_attention", "sliding_attention"] and m.sliding_window == 4096
    assert (m.attn_logit_softcapping, m.final_logit_softcapping, m.query_pre_attn_scalar) == (50.0, 30.0, 256)


# Phi-3-mini-128k's LongRoPE as its authors wrote it (type su, 4.x rope_scaling), and transformers' own reading of
# "yarn" in a Phi-3 config as LongRoPE; Phi-4-mini's partial rotary
def _phi3(path, **changes):
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 96, "vocab_size": 49152, "max_position_embeddings": 2048,
              "original_max_position_embeddings": 512, "rope_theta": 10000.0, "sliding_window": 262144,
              "rope_scaling": {"type": "su", **factors}} | changes
    return raw_folder(path, config)


@pytest.mark.parametrize("scaling_type", ["su", "longrope", "yarn"])
def test_phi3_longrope_spellings(resolved, tmp_path, scaling_type):
    folder = _phi3(tmp_path / scaling_type, rope_scaling={"type": scaling_type, "short_factor": [1.0] * 8,
                                                          "long_factor": [2.0] * 8})
    cfg = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy")
    assert cfg.model.rope_scaling["rope_type"] == "longrope" and cfg.model.max_model_len == 2048
    assert cfg.model.rope_scaling["original_max_position_embeddings"] == 512 and cfg.model.sliding_window == 262144
    assert rules.check_all(cfg) == []


def test_phi4_mini_partial_rotary(resolved, tmp_path):
    folder = _phi3(tmp_path / "mini", partial_rotary_factor=0.75, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    cfg = resolved("model=auto", f"model.path={folder}", "model.load_format=dummy")
    assert cfg.model.partial_rotary_factor == 0.75 and rules.check_all(cfg) == []
    wrong = _phi3(tmp_path / "wrong", partial_rotary_factor=0.75)  # factors for the whole head: 8, not 6
    [v] = assert_only(rules.check_all(resolved("model=auto", f"model.path={wrong}", "model.load_format=dummy")),
                      "rope_scaling_supported")
    assert "must be 6 numbers" in v.message


# config.json features of these families that llaunch does not run: refused at start naming the key
UNSERVED = [
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("phi3", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "yarn", "factor": 2.0,
                                                               "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention rope_type 'yarn'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize("family,changes,named", UNSERVED)
def test_unserved_features_exit_2_naming_the_key(resolved, compose_config, tmp_path, family, changes, named):
    folder = config_folder(tmp_path / family, family, **changes)
    overrides = ("model=auto", f"model.path={folder}", "model.load_format=dummy", "device=cpu", "dry_run=true")
    [v] = assert_only(rules.check_all(resolved(*overrides)), "checkpoint_features_supported")
    assert named in v.message
    assert main.launch(compose_config(*overrides), tmp_path / "run") == main.EXIT_INVALID


def test_unserved_variant_keys_exit_2_naming_them(resolved):
    [v] = assert_only(rules.check_all(resolved("model=gemma3-12b", "model.load_format=dummy", "model.tokenizer=null",
                                               "model.hidden_act=relu")), "model_variants_served")
    assert "model.hidden_act='relu'" in v.message
    [v] = assert_only(rules.check_all(resolved("model=phi4", "model.load_format=dummy", "model.tokenizer=null",
                                               "model.partial_rotary_factor=1.5")), "model_variants_served")
    assert "model.partial_rotary_factor=1.5" in v.message and "0 < factor <= 1" in v.message
