"""Checkpoints the worker cannot serve are refused at start, naming model.path: a base model saved without
its LM head (unless its config ties the head to the embeddings), a URL llaunch does not fetch, a path
that does not exist (with a hint that fits it)."""
from __future__ import annotations

import json

import pytest

from llaunch.launcher import derive, rules, store
from llaunch.runtime.models.checkpoint import safetensors_names

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, eos_token_id=2)


@pytest.fixture
def checked(compose_config):
    """`checked(*overrides)`: every violation of a Qwen2 instance on CPU (any free port)."""
    def run(*overrides):
        return rules.check_all(derive.resolve(compose_config("model=qwen2", "device=cpu", "server.port=0", *overrides)))
    return run


def saved(path, cls_name: str, **config):
    """A tiny transformers Qwen2 model of class `cls_name`, saved as transformers saves it."""
    import transformers

    cfg = transformers.Qwen2Config(**TINY | config)
    getattr(transformers, cls_name)(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_untied(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("base") / "ckpt", "Qwen2Model", tie_word_embeddings=False)


def test_a_base_model_without_its_head_is_refused_naming_it(checked, base_untied):
    assert "lm_head.weight" not in safetensors_names(str(base_untied))
    [v] = checked(f"model.path={base_untied}")
    assert v.rule == "checkpoint_has_lm_head" and v.keys == ("model.path", "model.tie_word_embeddings")
    assert f"model.path={base_untied} has no LM head (Qwen2Model" in v.message and "lm_head.weight" in v.message
    assert "model.tie_word_embeddings=false" in v.message
    assert checked(f"model.path={base_untied}", "model.load_format=dummy") == []  # random weights need no head


def test_a_tied_base_model_and_a_causal_lm_are_served(checked, tmp_path):
    tied = saved(tmp_path / "tied", "Qwen2Model", tie_word_embeddings=True)
    assert checked(f"model.path={tied}") == []  # the head is the embedding, as transformers ties it
    causal = saved(tmp_path / "causal", "Qwen2ForCausalLM", tie_word_embeddings=False)
    assert checked(f"model.path={causal}") == []
    score = saved(tmp_path / "score", "Qwen2ForSequenceClassification", num_labels=2, tie_word_embeddings=False)
    assert checked(f"model.path={score}") == []  # a score head, no LM head: model.task=score


def test_a_sharded_index_is_read_and_a_broken_header_is_named(checked, base_untied, tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text((base_untied / "config.json").read_text())
    weight_map = {name: "model-00001-of-00002.safetensors" for name in safetensors_names(str(base_untied))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    [v] = checked(f"model.path={folder}")
    assert v.rule == "checkpoint_has_lm_head"
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert checked(f"model.path={folder}") == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((base_untied / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    [v] = checked(f"model.path={broken}")
    assert v.rule == "checkpoint_has_lm_head" and "cannot read the safetensors header" in v.message


@pytest.mark.parametrize("overrides,key,fix", [
    (["model.path=s3://bucket/qwen2"], "model.path", "copy it to this host"),
    (["model.path=hf://Qwen/Qwen2-0.5B"], "model.path", "model.path=Qwen/Qwen2-0.5B"),
    (["model=qwen2-0.5b", "model.load_format=dummy", "model.tokenizer=https://example.com/tok"], "model.tokenizer",
     "copy it to this host"),
    (["model=qwen2-0.5b", "model.load_format=dummy", "model.tokenizer=null", "spec=draft",
      "spec.draft_model_path=gs://b/draft"], "spec.draft_model_path", "copy it to this host"),
])
def test_a_url_is_refused_before_anything_starts(checked, overrides, key, fix):
    found = checked(*overrides, "dry_run=true")  # a dry run refuses it too: no host fetches it
    [v] = [v for v in found if v.rule == "checkpoint_path_local"]
    assert v.keys == (key,) and v.message.startswith(f"{key}={overrides[-1].split('=', 1)[1]}: llaunch does not fetch")
    assert fix in v.message
    assert not [v for v in found if v.rule in ("weights_need_path", "tokenizer_exists", "spec_draft_model_usable")
                and key in v.keys]  # said once


def test_a_missing_path_names_model_path_and_the_hint_fits_it(checked, monkeypatch, tmp_path):
    [v] = checked("model.path=/nonexistent")
    assert v.rule == "weights_need_path" and v.message.startswith("model.path=/nonexistent does not exist")
    assert "SmolLM2" not in v.message and "prepare_models" not in v.message and "Hub id" in v.message
    monkeypatch.setenv("LLAUNCH_MODELS_DIR", str(tmp_path))
    [v] = checked("model=smollm2-135m")  # the bundled model, not prepared here
    assert v.rule == "weights_need_path" and "scripts/prepare_models.py" in v.message
    assert store.models_dir() == str(tmp_path)
