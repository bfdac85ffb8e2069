"""spec.method=draft at start-up: a draft checkpoint with the model's tokenizer is accepted, resolved
like the model (in its dtype and context) and counted in the memory plan; a missing draft, one with
another tokenizer or a score head, and a host KV tier beside a draft are refused, naming the keys."""
from __future__ import annotations

import json
import shutil

import pytest

from fixtures.tiny_models import write_tiny_checkpoint
from llaunch.launcher import derive, memory_plan, rules


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-rules")
    target = write_tiny_checkpoint(root / "target", "qwen2")
    draft = write_tiny_checkpoint(root / "draft", "llama", seed=3, num_hidden_layers=1)
    foreign = root / "foreign"
    shutil.copytree(draft, foreign)
    tok = json.loads((foreign / "tokenizer.json").read_text())
    first = next(iter(tok["model"]["vocab"]))
    tok["model"]["vocab"][first + "x"] = tok["model"]["vocab"].pop(first)  # one token spelled otherwise
    (foreign / "tokenizer.json").write_text(json.dumps(tok))
    scorer = root / "scorer"
    shutil.copytree(draft, scorer)
    config = json.loads((scorer / "config.json").read_text())
    (scorer / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForSequenceClassification"]}))
    return dict(target=target, draft=draft, foreign=foreign, scorer=scorer)


def check(compose_config, folders, *overrides):
    cfg = derive.resolve(compose_config("model=qwen2", f"model.path={folders['target']}", "device=cpu",
                                        "spec=draft", *overrides))
    return cfg, [v for v in rules.check_all(cfg) if not v.rule.startswith("server_port")]


def test_a_draft_with_the_models_tokenizer_is_accepted_and_planned(compose_config, folders):
    cfg, violations = check(compose_config, folders, f"spec.draft_model_path={folders['draft']}")
    assert violations == []
    draft = derive.resolve_draft(cfg)
    assert (draft.family, draft.num_hidden_layers, draft.dtype, draft.max_model_len) == (
        "llama", 1, cfg.model.dtype, cfg.model.max_model_len)
    without = derive.resolve(compose_config("model=qwen2", f"model.path={folders['target']}", "device=cpu"))
    plain, drafted = memory_plan._rank_memory(without), memory_plan._rank_memory(cfg)
    assert drafted.weights > plain.weights and drafted.kv_per_token > plain.kv_per_token  # the draft's share


@pytest.mark.parametrize("which, says", [("foreign", "tokenizer"), ("scorer", "causal LM"),
                                         ("missing", "does not exist")])
def test_an_unusable_draft_is_refused(compose_config, folders, which, says):
    path = folders.get(which, folders["draft"].parent / "nowhere")
    _, violations = check(compose_config, folders, f"spec.draft_model_path={path}")
    assert [v.rule for v in violations] == ["spec_draft_model_usable"]
    assert says in violations[0].message and "spec.draft_model_path" in violations[0].keys


def test_a_host_kv_tier_is_refused_with_a_draft(compose_config, folders):
    _, violations = check(compose_config, folders, f"spec.draft_model_path={folders['draft']}", "cache.cpu_tokens=4096")
    assert [(v.rule, v.keys) for v in violations] == [("spec_draft_model_usable", ("spec.method", "cache.cpu_tokens"))]
