"""Weight loading: GGUF vs the transformers-converted folder, tensor-parallel shards vs the full
checkpoint tensors, sharded/tied checkpoints, dummy weights, and config.json parsing."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from llaunch.runtime.config import LoadFormat
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.models import weights
from llaunch.runtime.models.checkpoint import read_checkpoint
from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import (model_config_from_folder, read_config_json, smollm2_dir, smollm2_gguf,
                                  write_tiny_checkpoint)

CPU = torch.device("cpu")


def build(cfg, rank: int = 0, size: int = 1):
    # no forward, so tp_size > 1 needs no process group
    return build_model(cfg, device=CPU, dtype=torch.float32, tp_rank=rank, tp_size=size)


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {f: write_tiny_checkpoint(tmp_path_factory.mktemp(f), f) for f in ("qwen2", "llama")}


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_gguf_loader_equals_converted_safetensors():
    folder = smollm2_dir()
    if not (folder / "model.safetensors").is_file():
        pytest.fail(f"{folder} missing: run scripts/prepare_models.py (make setup)")
    gguf = smollm2_gguf()
    from_gguf_meta = ModelArch.from_checkpoint(read_checkpoint(str(gguf)))
    from_json = ModelArch.from_hf_config(read_config_json(folder))
    assert from_gguf_meta.rms_norm_eps == pytest.approx(from_json.rms_norm_eps, rel=1e-6)  # GGUF stores float32
    assert replace(from_gguf_meta, rms_norm_eps=from_json.rms_norm_eps) == from_json
    st_cfg = model_config_from_folder(folder)
    from_st = params(build(st_cfg))
    from_gguf = params(build(replace(st_cfg, path=str(gguf.parent), load_format=LoadFormat.gguf)))
    assert from_st.keys() == from_gguf.keys()
    for name in from_st:
        assert torch.equal(from_st[name], from_gguf[name]), name


@pytest.mark.parametrize("family,tp", [("qwen2", 2), ("qwen2", 4), ("llama", 2)])
def test_tp_shards_concatenate_to_full_tensors(tiny, family, tp):
    folder = tiny[family]
    cfg = model_config_from_folder(folder)
    arch = ModelArch.from_model_config(cfg)
    full = load_file(str(folder / "model.safetensors"))
    ranks = [params(build(cfg, r, tp)) for r in range(tp)]
    d, heads, kv = arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    q_local, group = heads // tp * d, heads // kv
    kv_local = max(kv // tp, 1) * d  # fewer KV heads than ranks: one (replicated) head per rank

    def cat(name, dim=0):
        return torch.cat([p[name] for p in ranks], dim=dim)

    assert torch.equal(cat("embed_tokens.weight"), full["model.embed_tokens.weight"])
    if arch.tie_word_embeddings:
        assert "lm_head.weight" not in ranks[0] and "lm_head.weight" not in full
    else:
        assert torch.equal(cat("lm_head.weight"), full["lm_head.weight"])
    assert all(torch.equal(p["norm.weight"], full["model.norm.weight"]) for p in ranks)
    for i in range(arch.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        for kind in ("weight", "bias") if arch.attention_bias else ("weight",):
            for r, p in enumerate(ranks):
                q, k, v = p[f"{ours}.self_attn.qkv_proj.{kind}"].split([q_local, kv_local, kv_local])
                assert torch.equal(q, full[f"{hf}.self_attn.q_proj.{kind}"][r * q_local : (r + 1) * q_local])
                # the KV heads this rank holds are those its q heads read under grouped-query attention
                first_kv = (r * heads // tp) // group
                assert torch.equal(k, full[f"{hf}.self_attn.k_proj.{kind}"][first_kv * d : first_kv * d + kv_local])
                assert torch.equal(v, full[f"{hf}.self_attn.v_proj.{kind}"][first_kv * d : first_kv * d + kv_local])
        assert torch.equal(cat(f"{ours}.self_attn.o_proj.weight", 1), full[f"{hf}.self_attn.o_proj.weight"])
        gate_up = [p[f"{ours}.mlp.gate_up_proj.weight"].chunk(2) for p in ranks]
        assert torch.equal(torch.cat([g for g, _ in gate_up]), full[f"{hf}.mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([u for _, u in gate_up]), full[f"{hf}.mlp.up_proj.weight"])
        assert torch.equal(cat(f"{ours}.mlp.down_proj.weight", 1), full[f"{hf}.mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert all(torch.equal(p[f"{ours}.{norm}.weight"], full[f"{hf}.{norm}.weight"]) for p in ranks)


def test_vocab_not_divisible_by_tp_pads_last_block_with_zeros(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen2", vocab_size=49155)
    cfg = model_config_from_folder(folder)
    full = load_file(str(folder / "model.safetensors"))
    r0, r1 = params(build(cfg, 0, 2)), params(build(cfg, 1, 2))
    for name, hf in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        assert r0[name].shape == r1[name].shape == (24578, 64)
        assert torch.equal(torch.cat([r0[name], r1[name][:-1]]), full[hf])
        assert not r1[name][-1].any()


def test_sharded_checkpoint_with_index_loads_the_same(tiny, tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen2", max_shard_size="1MB")  # same seed as tiny["qwen2"]
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    sharded = params(build(model_config_from_folder(folder)))
    single = params(build(model_config_from_folder(tiny["qwen2"])))
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[n], single[n]) for n in single)


def test_missing_lm_head_ties_to_embedding(tiny):
    cfg = replace(model_config_from_folder(tiny["llama"]), tie_word_embeddings=False)  # the file has no lm_head
    p = params(build(cfg))
    assert torch.equal(p["lm_head.weight"], p["embed_tokens.weight"])


def test_shape_mismatch_names_the_tensor(tiny):
    cfg = replace(model_config_from_folder(tiny["llama"]), intermediate_size=256)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\)"):
        build(cfg)


def dummy_cfg(tiny, **overrides):
    return replace(model_config_from_folder(tiny["llama"]), path=None, load_format=LoadFormat.dummy, **overrides)


def test_dummy_weights_are_seeded_sane_and_tp_invariant(tiny):
    cfg = dummy_cfg(tiny, seed=7)
    whole = params(build(cfg))
    assert all(torch.equal(whole[n], p) for n, p in params(build(cfg)).items())
    other_seed = params(build(replace(cfg, seed=8)))
    assert not torch.equal(whole["layers.0.mlp.down_proj.weight"], other_seed["layers.0.mlp.down_proj.weight"])
    assert torch.equal(whole["layers.1.input_layernorm.weight"], torch.ones(64))
    assert abs(whole["layers.0.mlp.gate_up_proj.weight"].std().item() - 0.02) < 0.002
    halves = [params(build(cfg, r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([h["embed_tokens.weight"] for h in halves]), whole["embed_tokens.weight"])
    assert torch.equal(torch.cat([h["layers.0.self_attn.o_proj.weight"] for h in halves], 1),
                       whole["layers.0.self_attn.o_proj.weight"])


def test_dummy_shard_mode_draws_only_the_slice(tiny, monkeypatch):
    monkeypatch.setattr(weights, "DUMMY_FULL_TENSOR_MAX_PARAMS", 0)
    cfg = dummy_cfg(tiny)
    r0, r1 = params(build(cfg, 0, 2)), params(build(cfg, 1, 2))
    qkv0, qkv1 = r0["layers.0.self_attn.qkv_proj.weight"], r1["layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv0, params(build(cfg, 0, 2))["layers.0.self_attn.qkv_proj.weight"])
    q_rows = 2 * 16  # llama: the one KV head is replicated, drawn from the same slice on both ranks
    assert torch.equal(qkv0[q_rows:], qkv1[q_rows:]) and not torch.equal(qkv0[:q_rows], qkv1[:q_rows])
    assert abs(r1["layers.1.mlp.down_proj.weight"].std().item() - 0.02) < 0.003
    assert torch.equal(r1["norm.weight"], torch.ones(64))


def test_dummy_model_gives_sane_logits(tiny):
    model = build(dummy_cfg(tiny))
    tables = SlotTables(model)
    logits = model.forward(tables.batch(prefill=[(0, [5, 17, 300, 9000, 49151])], all_logits=True), tables.kv)
    assert torch.isfinite(logits).all() and 0.01 < logits.std().item() < 2.0


def test_arch_from_hf_config_variants():
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64}
    v4 = ModelArch.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert (v4.rope_theta, v4.rope_scaling["rope_type"], v4.head_dim, v4.num_key_value_heads) == (5e5, "llama3", 16, 4)
    v5 = ModelArch.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (v5.rope_theta, v5.rope_scaling, v5.attention_bias, v5.o_proj_bias) == (1e6, None, False, False)
    qwen = ModelArch.from_hf_config({**base, "model_type": "qwen2"})
    assert qwen.attention_bias and not qwen.o_proj_bias
    with pytest.raises(ValueError, match="not supported"):
        ModelArch.from_hf_config({**base, "model_type": "gemma"})


def test_qwen2_gguf_loads_like_transformers_reads_it(tiny, tmp_path):
    """A float32 Qwen2 GGUF (no q/k permutation for qwen2, biases): transformers' GGUF reader is the
    oracle that the file holds the checkpoint; our loader must then give the safetensors weights."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, path = tiny["qwen2"], tmp_path / "tiny-qwen2.gguf"
    hf, full = read_config_json(folder), load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    for name, t in full.items():
        writer.add_tensor(weights.gguf_tensor_name(name), t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert theirs.keys() == full.keys() and all(torch.equal(theirs[n], full[n]) for n in full)

    meta, expected = ModelArch.from_checkpoint(read_checkpoint(str(path))), ModelArch.from_hf_config(hf)
    assert meta.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)  # GGUF stores float32
    assert replace(meta, rms_norm_eps=expected.rms_norm_eps) == expected
    cfg = model_config_from_folder(folder)
    from_gguf = params(build(replace(cfg, path=str(path), load_format=LoadFormat.gguf)))
    from_st = params(build(cfg))
    assert from_gguf.keys() == from_st.keys() and all(torch.equal(from_gguf[n], from_st[n]) for n in from_st)


def test_loading_reports_its_progress_by_parameter_bytes(tiny):
    cfg = model_config_from_folder(tiny["qwen2"])
    seen: list[float] = []
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, progress=seen.append)
    sizes = [p.numel() for p in dict(model.named_parameters()).values()]
    assert len(seen) == len(sizes) and seen == sorted(seen) and seen[-1] == 1.0
    assert seen[0] == pytest.approx(sizes[0] / sum(sizes))
