"""A quantized checkpoint llaunch does not implement is refused at plan time, naming its format and
what is served; the fp8 layouts it does implement pass (block-wise ones too), and so does
transformers 5's nesting of quantization_config inside a text_config; a tensor-parallel size that
would cut a block-wise checkpoint's blocks of input columns is refused, naming the layers and the
sizes that do not."""
from __future__ import annotations

import json

import pytest

from llaunch.launcher import rules
from llaunch.runtime.models.quant_scheme import DYNAMIC, NONE, STATIC, checkpoint_weight_quant, splits_blocks
from unit.test_rules import assert_only, free_port, resolved, tiny_llama_folder  # noqa: F401 (fixtures)


def fp8_group(strategy="channel", act=None, **weights):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
                                           "dynamic": False, **weights},
        "input_activations": act, "output_activations": None}}, "ignore": ["lm_head"]}


TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
STATIC_TENSOR = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
GROUP = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True, "symmetric": True}
FP8_BLOCK = fp8_group("block", GROUP, block_structure=[128, 128])  # llm-compressor's FP8_BLOCK
BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}}}}


@pytest.mark.parametrize("q,activations", [
    (fp8_group("channel", TOKEN), DYNAMIC), (fp8_group("tensor", STATIC_TENSOR), STATIC), (fp8_group(), NONE),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, DYNAMIC),
    ({"quant_method": "fp8", "activation_scheme": "static"}, STATIC), (BLOCK_FP8, DYNAMIC), (FP8_BLOCK, DYNAMIC),
    (fp8_group("block", None, block_structure=[128, 128]), NONE),
])
def test_fp8_layouts_are_served(q, activations):
    wq = checkpoint_weight_quant({"quantization_config": q})
    assert wq.served and wq.activations == activations, wq.problems


def test_block_wise_layouts_say_their_blocks_and_scale_tensor():
    """DeepSeek-V3's and Qwen3's fp8 releases name their block scales weight_scale_inv (they multiply
    all the same), compressed-tensors weight_scale; per-channel checkpoints have no blocks."""
    fp8, ct = (checkpoint_weight_quant({"quantization_config": q}) for q in (BLOCK_FP8, FP8_BLOCK))
    assert (fp8.block, fp8.scale_name) == ((128, 128), "weight_scale_inv")
    assert (ct.block, ct.scale_name) == ((128, 128), "weight_scale")
    plain = checkpoint_weight_quant({"quantization_config": fp8_group("channel", TOKEN)})
    assert (plain.block, plain.scale_name) == (None, "weight_scale")


def test_splits_blocks_finds_a_rank_starting_inside_a_block():
    assert not splits_blocks([(256, 256)], 128)
    assert not splits_blocks([(0, 192)], 128)  # a rank's last group may be narrower
    assert splits_blocks([(192, 192)], 128)
    assert splits_blocks([(0, 64), (None, 64)], 128)  # a zero head after a narrow run
    assert not splits_blocks([(0, 128), (None, 128), (512, 64)], 128)


@pytest.mark.parametrize("q,named", [
    (AWQ, "quant_method=awq (4-bit)"), (GPTQ, "quant_method=gptq (4-bit)"),
    (W4A16, "format=pack-quantized"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method=bitsandbytes"),
    (BLOCK_FP8 | {"activation_scheme": "static"}, "activation_scheme=static with weight_block_size"),
    (BLOCK_FP8 | {"weight_block_size": [128, 96]}, "weight_block_size=[128, 96] (a block's columns must be a power"),
    (BLOCK_FP8 | {"weight_block_size": 128}, "weight_block_size=128 (two positive integers"),
    (fp8_group("block", TOKEN, block_structure=[128, 128]), "input_activations strategy=token dynamic=True"),
    (fp8_group("channel", GROUP), "input_activations strategy=group without block weights"),
])
def test_other_quantizations_are_refused_by_name(resolved, tmp_path, q, named):  # noqa: F811
    folder = tiny_llama_folder(tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": q}))
    [v] = assert_only(rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto")),
                      "checkpoint_quantization_supported")
    assert named in v.message and "compressed-tensors float-quantized fp8" in v.message and "fbgemm_fp8" in v.message


def test_a_quantization_config_nested_in_text_config_is_read(resolved, tmp_path):  # noqa: F811
    folder = tiny_llama_folder(tmp_path / "nested")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "text_config": config | {"quantization_config": AWQ}}))
    [v] = assert_only(rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto")),
                      "checkpoint_quantization_supported")
    assert "awq" in v.message
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": fp8_group("channel", TOKEN)}))
    from llaunch.runtime.models.checkpoint import read_checkpoint
    read_checkpoint.cache_clear()
    assert rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto")) == []
    # its e4m3 layers take the fp8 GEMVs at one row: kernels.row_invariant cannot hold
    [v] = assert_only(rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto", "model.dtype=bfloat16",
                                               "kernels.row_invariant=true")), "row_invariant_covers_model")
    assert v.keys == ("kernels.row_invariant", "model.path") and "compressed-tensors" in v.message


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_quantizing_at_load_a_checkpoint_already_quantized_is_refused(resolved, tmp_path, quantization):  # noqa: F811
    """model.quantization quantizes a float checkpoint at load; an fp8 checkpoint is served as it is, so the key would
    do nothing (int8 asked, e4m3 served): refused, naming both keys."""
    folder = tiny_llama_folder(tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": fp8_group("channel", TOKEN)}))
    base = (f"model.path={folder}", "model.load_format=auto")
    assert rules.check_all(resolved(*base)) == []
    [v] = assert_only(rules.check_all(resolved(*base, f"model.quantization={quantization}")),
                      "checkpoint_quantization_supported")
    assert v.keys == ("model.quantization", "model.path") and "compressed-tensors" in v.message


def test_the_dry_run_shows_fp8_weight_and_kv_bytes(resolved):  # noqa: F811
    from llaunch.launcher import memory_plan

    base = ("model=qwen2-7b", "model.load_format=dummy", "model.dtype=bfloat16", "cache.max_total_tokens=null")
    plain, fp8 = (memory_plan.summary(resolved(*base, *extra)) for extra in
                  ((), ("model.quantization=fp8", "cache.kv_dtype=fp8_e4m3")))
    assert "weights 14.2 GiB (bfloat16)" in plain and "KV 56 KiB per token (bfloat16)" in plain
    # Qwen2-7B's linears (6.5 B parameters) at 1 byte, embedding and LM head (1.1 B) at 2
    assert "weights 8.1 GiB (fp8 linears + bfloat16)" in fp8 and "KV 28 KiB per token (fp8_e4m3)" in fp8
    tokens = [int(s.rsplit(": ", 1)[1].split(" tokens")[0].replace(",", "")) for s in (plain, fp8)]
    assert tokens[1] // 2 == tokens[0]  # the same KV budget holds twice the tokens
    # model.quantization=int8: the same bytes as e4m3
    int8 = memory_plan.summary(resolved(*base, "model.quantization=int8"))
    assert "weights 8.1 GiB (int8 linears + bfloat16)" in int8


@pytest.mark.parametrize("profile", ["qwen2-7b", "smollm2-135m"])
def test_an_fp8_lm_head_frees_an_own_head_and_adds_to_a_tied_one(resolved, profile):  # noqa: F811
    from llaunch.launcher import memory_plan
    from llaunch.runtime.models.memory import rank_memory

    base = (f"model={profile}", "model.load_format=dummy", "model.dtype=bfloat16", "model.quantization=fp8")
    cfg, with_head = resolved(*base), resolved(*base, "model.fp8_lm_head=true")
    head = cfg.model.vocab_size * cfg.model.hidden_size
    # Qwen2-7B's own head: 2 bytes a weight become 1; SmolLM2's tied embedding keeps its 2 and the head adds 1
    assert rank_memory(with_head).weights - rank_memory(cfg).weights == (head if cfg.model.tie_word_embeddings
                                                                         else -head)
    assert "(fp8 linears and LM head + bfloat16)" in memory_plan.summary(with_head)


# a block-wise fp8 checkpoint's config as transformers writes it: 4 heads of 64 (2 KV), intermediate 512
WIDE = dict(hidden_size=320, intermediate_size=512, head_dim=64, num_key_value_heads=2)


def test_a_tp_that_cuts_blocks_is_refused_naming_the_layers(resolved, tmp_path):  # noqa: F811
    folder = tiny_llama_folder(tmp_path / "block", **WIDE)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": BLOCK_FP8}))
    base = (f"model.path={folder}", "model.load_format=auto", *(f"model.{k}={v}" for k, v in WIDE.items()))
    assert rules.check_all(resolved(*base, "parallel.tp=2")) == []  # o_proj 128 columns, down_proj 256 a rank
    # tp4: each rank's one head of 64 o_proj columns starts mid-block on every other rank
    [v] = assert_only(rules.check_all(resolved(*base, "parallel.tp=4")), "checkpoint_quantization_supported")
    assert v.keys == ("model.path", "parallel.tp")
    assert "o_proj (64 columns a rank: 1 head of 64)" in v.message and "down_proj" not in v.message
    assert "blocks of 128x128" in v.message and "Use parallel.tp of 1, 2" in v.message
