"""A quantized checkpoint llaunch does not implement is refused at plan time, naming its format and
what is served; the fp8 layouts it does implement pass, and so does transformers 5's nesting of
quantization_config inside a text_config."""
from __future__ import annotations

import json

import pytest

from llaunch.launcher import rules
from llaunch.runtime.models.quant_scheme import DYNAMIC, NONE, STATIC, checkpoint_weight_quant
from unit.test_rules import assert_only, free_port, resolved, tiny_llama_folder  # noqa: F401 (fixtures)


def fp8_group(strategy="channel", act=None):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
                                           "dynamic": False},
        "input_activations": act, "output_activations": None}}, "ignore": ["lm_head"]}


TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
STATIC_TENSOR = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}}}}


@pytest.mark.parametrize("q,activations", [
    (fp8_group("channel", TOKEN), DYNAMIC), (fp8_group("tensor", STATIC_TENSOR), STATIC), (fp8_group(), NONE),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, DYNAMIC),
    ({"quant_method": "fp8", "activation_scheme": "static"}, STATIC),
])
def test_fp8_layouts_are_served(q, activations):
    wq = checkpoint_weight_quant({"quantization_config": q})
    assert wq.served and wq.activations == activations, wq.problems


@pytest.mark.parametrize("q,named", [
    (AWQ, "quant_method=awq (4-bit)"), (GPTQ, "quant_method=gptq (4-bit)"),
    (W4A16, "format=pack-quantized"), ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method=bitsandbytes"),
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
