"""Quantized checkpoints as a user launches them: one llaunch does not implement is refused before
anything starts (exit 2, naming its format and the served ones); an fp8 one plans, and its dry run
shows fp8 weight and KV bytes."""
from __future__ import annotations

import json

import pytest

from integration.test_cli import llaunch
from unit.test_rules import tiny_llama_folder

pytestmark = pytest.mark.timeout(300)

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def test_an_awq_checkpoint_is_refused_at_plan_time(tmp_path):
    folder = tiny_llama_folder(tmp_path / "awq")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": AWQ}))
    r = llaunch(tmp_path, "model=llama", f"model.path={folder}", "device=cpu", f"model.tokenizer={folder}")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "checkpoint_quantization_supported" in r.stderr and "quant_method=awq (4-bit)" in r.stderr
    assert "fbgemm_fp8" in r.stderr and "Traceback" not in r.stderr


def test_an_fp8_checkpoint_serves_with_an_fp8_kv_cache_and_calibrates(tmp_path_factory, tiny_dirs):
    """A compressed-tensors fp8 Qwen2 with cache.kv_dtype=fp8_e4m3, cache.kv_calibration and model.fp8_lm_head
    through a real graph: its greedy tokens and their logprobs are the in-process model's (same fp8 layers and head,
    same fp8 KV: the head in bf16 moves a logprob ~1e-2), and the workers write per-layer scales while they serve."""
    from dataclasses import replace

    import time

    import torch
    from openai import OpenAI

    from fixtures.fp8_checkpoints import write_fp8_checkpoint
    from fixtures.tiny_models import model_config_from_folder
    from integration.conftest import start_server
    from llaunch.runtime.config import CacheConfig, KvDType
    from llaunch.runtime.models.kv_fp8 import use_fp8_kv
    from llaunch.runtime.models.loader import build_model
    from fixtures.forward_batches import SlotTables
    from unit.test_fp8_weights import llaunch_greedy

    root = tmp_path_factory.mktemp("fp8-served")
    write_fp8_checkpoint(tiny_dirs["qwen2"], root / "fp8", root / "oracle", "compressed-tensors")
    scales = root / "kv.json"
    tokenizer_ids = None
    with start_server(tmp_path_factory, "fp8", ["model=qwen2", f"model.path={root / 'fp8'}", "model.name=fp8",
                                                "cache.kv_dtype=fp8_e4m3", f"cache.kv_calibration={scales}",
                                                "model.fp8_lm_head=true"]) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = api.completions.create(model="fp8", prompt="Once upon a time, in a land far away, there lived",
                                     max_tokens=10, temperature=0, logprobs=1,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
        served = out.choices[0].model_extra["token_ids"]
        served_logprobs = out.choices[0].logprobs.token_logprobs
        tokenizer_ids = out.choices[0].model_extra.get("prompt_token_ids")
        deadline = time.monotonic() + 30  # the workers write it within 2 s of the absmax moving
        while not scales.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    written = json.loads(scales.read_text())
    assert len(written["k_scale"]) == 2 and all(a > 0 for a in written["k_absmax"] + written["v_absmax"])
    from transformers import AutoTokenizer

    prompt = tokenizer_ids or AutoTokenizer.from_pretrained(root / "fp8")(
        "Once upon a time, in a land far away, there lived")["input_ids"]
    cfg = replace(model_config_from_folder(root / "fp8"), fp8_lm_head=True)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    use_fp8_kv(model, CacheConfig(kv_dtype=KvDType.fp8_e4m3))
    assert model.lm_head.qweight is not None
    assert served == llaunch_greedy(model, prompt, 10)
    tables = SlotTables(model, max_rows=1, max_len=64)  # decoded as served: each step reads the e4m3 KV before it
    logits = [model.forward(tables.batch(prefill=[(0, prompt)]), tables.kv)[-1]]
    logits += [model.forward(tables.batch(decode=[(0, t)]), tables.kv)[-1] for t in served[:-1]]
    want = [torch.log_softmax(row.float(), dim=-1)[t].item() for row, t in zip(logits, served)]
    assert max(abs(a - b) for a, b in zip(served_logprobs, want)) <= 1e-4, (served_logprobs, want)


def test_a_block_wise_fp8_checkpoint_plans_and_a_tp_that_cuts_its_blocks_exits_2(tmp_path):
    """Qwen2-7B's shape as a block-wise fp8 release (config.json alone: a dry run reads no weights):
    tp2 plans with fp8 weights; tp8 splits down_proj's 18,944 input columns into 2,368 a rank, which
    is not a whole number of 128-column blocks, so it is refused before anything starts."""
    from gpu.conftest import profile_shape

    folder = tmp_path / "qwen2-7b-fp8"
    folder.mkdir()
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = profile_shape("qwen2-7b") | {"architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
                                          "quantization_config": block}
    (folder / "config.json").write_text(json.dumps(config))
    args = ("model=qwen2", f"model.path={folder}", "device=cuda", "dry_run=true")
    ok = llaunch(tmp_path, *args, "parallel.tp=2")
    assert ok.returncode == 0, ok.stderr
    assert "fp8 linears" in ok.stderr, ok.stderr
    (tmp_path / "tp8").mkdir()
    cut = llaunch(tmp_path / "tp8", *args, "parallel.tp=8", "parallel.pad_heads=true")
    assert cut.returncode == 2, (cut.stdout, cut.stderr)
    assert "checkpoint_quantization_supported" in cut.stderr and "parallel.tp=8" in cut.stderr
    assert "down_proj (2368 of intermediate_size=18944 a rank)" in cut.stderr
    assert "Use parallel.tp of 1, 2, 4" in cut.stderr


def test_int8_weights_serve_the_in_process_int8_model(tmp_path_factory, tiny_dirs):
    """model.quantization=int8 with model.int8_lm_head through a real graph (launcher → worker → loader): the greedy
    tokens and logprobs of the in-process model with the same int8 layers and head, not the float model's."""
    from dataclasses import replace

    import torch
    from openai import OpenAI

    from fixtures.forward_batches import SlotTables
    from fixtures.tiny_models import model_config_from_folder
    from integration.conftest import start_server
    from llaunch.runtime.config import WeightQuantization
    from llaunch.runtime.models.int8_linear import Int8Layer
    from llaunch.runtime.models.loader import build_model
    from unit.test_fp8_weights import llaunch_greedy

    folder = tiny_dirs["qwen2"]
    text = "Once upon a time, in a land far away, there lived"
    with start_server(tmp_path_factory, "int8", ["model=qwen2", f"model.path={folder}", "model.name=int8",
                                                 "model.quantization=int8", "model.int8_lm_head=true"]) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = api.completions.create(model="int8", prompt=text, max_tokens=10, temperature=0, logprobs=1,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
        served = out.choices[0].model_extra["token_ids"]
        served_logprobs = out.choices[0].logprobs.token_logprobs
        prompt = out.choices[0].model_extra.get("prompt_token_ids")
    if prompt is None:
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    cfg = replace(model_config_from_folder(folder), quantization=WeightQuantization.int8, int8_lm_head=True)
    int8_model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    assert any(isinstance(m, Int8Layer) for m in int8_model.modules())
    assert served == llaunch_greedy(int8_model, prompt, 10)

    def logprobs(model):  # of the served tokens, decoded as served
        tables = SlotTables(model, max_rows=1, max_len=64)
        rows = [model.forward(tables.batch(prefill=[(0, prompt)]), tables.kv)[-1]]
        rows += [model.forward(tables.batch(decode=[(0, t)]), tables.kv)[-1] for t in served[:-1]]
        return [torch.log_softmax(row.float(), dim=-1)[t].item() for row, t in zip(rows, served)]

    gap = lambda want: max(abs(a - b) for a, b in zip(served_logprobs, want))  # noqa: E731
    plain = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    assert gap(logprobs(int8_model)) <= 1e-4 < gap(logprobs(plain)), (served_logprobs, logprobs(int8_model))
