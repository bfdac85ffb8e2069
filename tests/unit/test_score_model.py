"""Score models (model.task=score): the task and head read from config.json's architectures, the
rules that refuse a head the task cannot use, and the score routes refused on a generating model."""
from __future__ import annotations

import httpx
import pytest

from llaunch.launcher import derive, rules
from llaunch.runtime.config import Device, ModelConfig, ModelTask, ScoreHead


def write_config(path, family: str, architecture: str, **overrides):
    """A config.json (transformers' own writer) of the tiny dimensions naming `architecture`."""
    from transformers import LlamaConfig, Qwen2Config

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, vocab_size=49152, max_position_embeddings=512,
                eos_token_id=2, pad_token_id=2)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    config_cls(**dims | overrides, architectures=[architecture]).save_pretrained(path)
    return path


def test_task_follows_the_architectures(tmp_path):
    reward = write_config(tmp_path / "reward", "qwen2", "Qwen2ForSequenceClassification", num_labels=1)
    m = derive.resolve_model(ModelConfig(path=str(reward)), Device.cpu)
    assert (m.task, m.num_labels, m.labels, m.pad_token_id) == (ModelTask.score, 1, ["LABEL_0"], 2)

    labels = {0: "bad", 1: "ok", 2: "good"}
    cls = write_config(tmp_path / "cls", "llama", "LlamaForSequenceClassification", id2label=labels,
                       label2id={v: k for k, v in labels.items()})
    m = derive.resolve_model(ModelConfig(path=str(cls)), Device.cpu)
    assert (m.task, m.num_labels, m.labels) == (ModelTask.score, 3, ["bad", "ok", "good"])

    lm = write_config(tmp_path / "lm", "llama", "LlamaForCausalLM")
    m = derive.resolve_model(ModelConfig(path=str(lm)), Device.cpu)
    assert (m.task, m.num_labels, m.labels) == (ModelTask.generate, None, None)
    # dummy weights: a profile that sizes a head scores
    m = derive.resolve_model(ModelConfig(family="llama", num_labels=2), Device.cpu)
    assert (m.task, m.labels) == (ModelTask.score, ["LABEL_0", "LABEL_1"])


@pytest.fixture
def violations(compose_config, tmp_path):
    def run(folder, *overrides: str):
        cfg = derive.resolve(compose_config("model=llama", "device=cpu", f"model.path={folder}", *overrides))
        return {v.rule: v.message for v in rules.check_all(cfg)}
    return run


def test_rules_refuse_a_head_the_task_cannot_use(tmp_path, violations):
    cls = write_config(tmp_path / "cls", "llama", "LlamaForSequenceClassification", num_labels=1)
    assert "score_needs_head" not in violations(cls) and "generate_needs_lm_head" not in violations(cls)
    found = violations(cls, "model.task=generate")
    assert "no LM head" in found["generate_needs_lm_head"] and "model.task=score" in found["generate_needs_lm_head"]

    lm = write_config(tmp_path / "lm", "llama", "LlamaForCausalLM")
    assert "has no score head" in violations(lm, "model.task=score")["score_needs_head"]

    reward = write_config(tmp_path / "rm", "qwen2", "Qwen2ForRewardModel")  # id2label of 2: still one reward
    assert "score_head_supported" not in violations(reward)
    m = derive.resolve_model(ModelConfig(path=str(reward)), Device.cpu)
    assert (m.task, m.num_labels, m.score_head) == (ModelTask.score, 1, ScoreHead.mlp)
    process = write_config(tmp_path / "prm", "qwen2", "Qwen2ForProcessRewardModel", num_labels=2)
    assert "Qwen2ForRewardModel" in violations(process)["score_head_supported"]

    pd = violations(cls, "mode=pd_decode")
    assert "mode.kind=pd_decode" in pd["score_not_in_pd_modes"]


def test_score_routes_refuse_a_generating_model(scripted_server):
    url = f"http://127.0.0.1:{scripted_server.port}"
    for path, body in [("/classify", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/get_score", {"chat": "hi"})]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "not_a_score_model" and "model.task=generate" in r.text


def test_a_scored_prompt_finishes_at_its_prefill_and_frees_its_kv():
    from llaunch.runtime.ipc.messages import StepResult
    from unit.scheduler_support import make, req

    s = make(batch_max_tokens=16, chunk=8, prompt_cache=True)
    s.add(req("a", 12, 1))
    s.add(req("b", 3, 1))
    p = s.schedule()  # a's first chunk and all of b: only b's last token is pooled this step
    assert [(c.row, c.sample) for c in p.prefill] == [(0, False), (1, True)]
    [d] = s.on_result(StepResult(step=p.step, rows=[1], token_ids=[], scores=[[0.5, -1.0]]))
    assert (d.request_id, d.token_ids, d.scores, d.finish_reason) == ("b", [], [0.5, -1.0], "stop")
    p = s.schedule()
    assert [(c.row, c.start, c.sample) for c in p.prefill] == [(0, 8, True)] and p.decode_rows == []
    [d] = s.on_result(StepResult(step=p.step, rows=[0], token_ids=[], scores=[[2.0, 3.0]]))
    assert (d.request_id, d.scores) == ("a", [2.0, 3.0])
    assert s.schedule() is None and s.num_running == 0  # nothing decodes after a score
    assert s.kv_in_use == 0  # the prompts' KV went to the prompt cache, evictable
