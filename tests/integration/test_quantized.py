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
