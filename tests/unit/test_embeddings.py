"""Embedding models (model.task=embed) and yes/no rerankers (model.score_head=yes_no) without a server: what a
sentence-transformers folder says (runtime/models/pooling_config.py), the task and fields the launcher derives,
the rules that refuse what llaunch does not compute, the per-chunk pooling of the worker, the prompt cache lending
nothing to a request that pools every position, and the frontend's truncation and normalization."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from llaunch.launcher import derive, rules
from llaunch.runtime.config import Device, ModelConfig, ModelTask, Pooling, ScoreHead
from llaunch.runtime.http.embeddings_api import EmbedModel
from llaunch.runtime.ipc.messages import StepResult
from llaunch.runtime.models.pooling import PooledRows
from llaunch.runtime.models.pooling_config import embedding_facts
from unit.scheduler_support import make
from unit.test_scheduler_prompt_cache import req_ids

DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=49152, max_position_embeddings=512, eos_token_id=2, pad_token_id=2)
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}


def sentence_folder(path, modules=("Pooling", "Normalize"), pooling="lasttoken", architecture="Qwen2Model",
                    **config):
    """config.json (transformers' writer) plus modules.json and the Pooling module's config, as
    sentence-transformers writes them."""
    from transformers import Qwen2Config

    Qwen2Config(**DIMS | config, architectures=[architecture]).save_pretrained(path)
    if modules is None:
        return path
    entries = [TRANSFORMER]
    for i, kind in enumerate(modules, 1):
        entries.append({"idx": i, "name": str(i), "path": f"{i}_{kind}", "type": f"sentence_transformers.models.{kind}"})
        (path / f"{i}_{kind}").mkdir()
        if kind == "Pooling":
            modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
            (path / f"{i}_{kind}" / "config.json").write_text(json.dumps(
                {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == pooling for m in modes}}))
    (path / "modules.json").write_text(json.dumps(entries))
    return path


def resolved(path, **model):
    return derive.resolve_model(ModelConfig(path=str(path), **model), Device.cpu)


def test_a_sentence_transformers_folder_says_its_pooling(tmp_path):
    facts = embedding_facts(str(sentence_folder(tmp_path / "last")))
    assert (facts.sentence_transformers, facts.pooling, facts.normalize) == (True, Pooling.last, True)
    facts = embedding_facts(str(sentence_folder(tmp_path / "mean", ("Pooling",), "mean_tokens")))
    assert (facts.pooling, facts.normalize, facts.unserved_pooling) == (Pooling.mean, False, None)
    assert embedding_facts(str(sentence_folder(tmp_path / "cls", ("Pooling",), "cls_token"))).pooling == Pooling.cls
    facts = embedding_facts(str(sentence_folder(tmp_path / "max", ("Pooling", "Dense"), "max_tokens")))
    assert facts.pooling is None and facts.unserved_pooling == "pooling max_tokens"
    assert facts.unserved_modules == ("a Dense module (2_Dense)",)
    facts = embedding_facts(str(sentence_folder(tmp_path / "mrl", None, matryoshka_dimensions=[16, 32])))
    assert (facts.sentence_transformers, facts.matryoshka, facts.matryoshka_dimensions) == (False, True, [16, 32])


def test_task_auto_embeds_a_sentence_transformers_folder(tmp_path):
    m = resolved(sentence_folder(tmp_path / "st", is_matryoshka=True))
    assert (m.task, m.pooling, m.normalize, m.matryoshka, m.matryoshka_dimensions) == (
        ModelTask.embed, Pooling.last, True, True, None)
    m = resolved(sentence_folder(tmp_path / "mean", ("Pooling",), "mean_tokens"))
    assert (m.task, m.pooling, m.normalize, m.matryoshka) == (ModelTask.embed, Pooling.mean, False, False)
    m = resolved(tmp_path / "mean", pooling=Pooling.cls, normalize=True)  # the keys override the folder
    assert (m.pooling, m.normalize) == (Pooling.cls, True)
    # a causal LM folder generates; asked to embed, it pools its last token, normalized (as vLLM)
    plain = sentence_folder(tmp_path / "lm", None, architecture="Qwen2ForCausalLM")
    assert resolved(plain).task == ModelTask.generate
    m = resolved(plain, task=ModelTask.embed, matryoshka_dimensions=[8, 16])
    assert (m.task, m.pooling, m.normalize, m.matryoshka) == (ModelTask.embed, Pooling.last, True, True)


def test_a_yes_no_head_takes_its_tokens_from_the_vocabulary(tmp_path):
    from fixtures.tiny_models import tokenizer_dir

    folder = sentence_folder(tmp_path / "rr", None, architecture="Qwen3ForCausalLM")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir() / name).read_bytes())
    m = resolved(folder, score_head=ScoreHead.yes_no)
    from transformers import AutoTokenizer
    yes_no = AutoTokenizer.from_pretrained(tokenizer_dir()).convert_tokens_to_ids(["yes", "no"])
    assert (m.task, m.num_labels, m.score_token_ids, m.pad_token_id) == (ModelTask.score, 1, yes_no, None)
    assert resolved(folder, score_head=ScoreHead.yes_no, score_token_ids=[5, 6]).score_token_ids == [5, 6]


@pytest.fixture
def violations(compose_config):
    def run(folder, *overrides: str):
        cfg = derive.resolve(compose_config("model=qwen2", "device=cpu", f"model.path={folder}", *overrides))
        return {v.rule: v.message for v in rules.check_all(cfg)}
    return run


def test_rules_refuse_what_llaunch_does_not_compute(tmp_path, violations):
    assert not {"embed_pooling_served", "embed_matryoshka_consistent"} & set(violations(sentence_folder(tmp_path / "ok")))
    folder = sentence_folder(tmp_path / "max", ("Pooling", "Normalize"), "max_tokens")
    found = violations(folder)
    assert "pooling max_tokens" in found["embed_pooling_served"] and "model.pooling" in found["embed_pooling_served"]
    assert "embed_pooling_served" not in violations(folder, "model.pooling=mean")  # served pooled as said
    found = violations(sentence_folder(tmp_path / "dense", ("Pooling", "Dense")))
    assert "a Dense module (2_Dense)" in found["embed_pooling_served"]

    folder = tmp_path / "ok"
    found = violations(folder, "model.matryoshka=false", "model.matryoshka_dimensions=[16]")
    assert "model.matryoshka=false" in found["embed_matryoshka_consistent"]
    assert "[65]" in violations(folder, "model.matryoshka_dimensions=[16,65]")["embed_matryoshka_consistent"]
    assert "mode.kind=pd_decode" in violations(folder, "mode=pd_decode")["score_not_in_pd_modes"]
    assert "model.task=embed" in violations(folder, "spec=ngram")["spec_where_rows_decode"]


def test_rules_of_a_yes_no_head(tmp_path, violations):
    lm = sentence_folder(tmp_path / "lm", None, architecture="Qwen2ForCausalLM")  # no tokenizer.json here
    found = violations(lm, "model.score_head=yes_no", f"model.tokenizer={lm}")
    assert "model.score_token_ids=[YES_ID,NO_ID]" in found["yes_no_tokens_known"]
    found = violations(lm, "model.score_head=yes_no", "model.score_token_ids=[3,3]")
    assert "two different token ids" in found["yes_no_tokens_known"]
    assert "yes_no_tokens_known" not in violations(lm, "model.score_head=yes_no", "model.score_token_ids=[3,4]")
    cls = sentence_folder(tmp_path / "cls", None, architecture="Qwen2ForSequenceClassification", num_labels=1)
    found = violations(cls, "model.score_head=yes_no", "model.score_token_ids=[3,4]")
    assert "Qwen2ForSequenceClassification" in found["score_needs_head"]


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_rows_over_chunks_equal_the_whole_prompt(pooling):
    torch.manual_seed(0)
    hidden = torch.randn(23, 8)
    rows = PooledRows(Pooling(pooling), max_rows=3, hidden_size=8, device=torch.device("cpu"))
    rows.start(2, 23, cached=0)
    rows.sums is None or rows.sums[2].fill_(5.0)  # a row's earlier request left its sums: start zeroes them
    rows.start(2, 23, cached=0)
    for start, n in [(0, 10), (10, 10), (20, 3)]:  # chunked prefill: 10 + 10 + 3 positions
        k = rows.positions(start, n)
        assert k == {"mean": n, "cls": int(start == 0), "last": 0}[pooling]
        if k:
            rows.add(hidden[start:start + k], [(2, k)])
    want = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
    torch.testing.assert_close(rows.pooled([2], hidden[-1:])[0], want)
    if pooling != "last":
        with pytest.raises(RuntimeError, match="cached prompt tokens"):
            rows.start(1, 23, cached=8)


def test_a_request_that_pools_every_position_is_lent_no_prefix():
    s = make(prompt_cache=True, batch_max_tokens=64, chunk=16)
    prompt = list(range(10, 30))
    s.add(req_ids("a", prompt, 1))
    while (p := s.schedule()) is not None:  # two chunks; the second's row returns its outputs
        rows = [c.row for c in p.prefill if c.sample]
        s.on_result(StepResult(step=p.step, rows=rows, token_ids=[], scores=[[0.5]] * len(rows)))
    assert s.cache.tree.num_tokens == 20  # a's prompt is in the cache now
    s.add(req_ids("last", prompt, 1))  # last pooling: all but the last token borrowed
    mean = req_ids("mean", prompt, 1)
    mean.pools_prompt = True
    s.add(mean)
    p = s.schedule()
    assert [len(n.cached_slots) for n in p.new] == [19, 0]
    assert [(c.start, len(c.token_ids)) for c in p.prefill] == [(19, 1), (0, 16)]  # mean's first chunk of two


def test_dimensions_truncate_then_normalize():
    model = EmbedModel(hidden_size=4, normalize=True, matryoshka=True, dimensions=(2, 4))
    assert model.size(None) == model.size(4) == 4 and model.size(2) == 2
    np.testing.assert_allclose(model.finish([3.0, 4.0, 12.0, 0.0], 2), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(model.finish([3.0, 4.0, 12.0, 0.0], 4), [3 / 13, 4 / 13, 12 / 13, 0.0], rtol=1e-6)
    with pytest.raises(Exception, match="one of \\[2, 4\\]"):
        model.size(3)
    raw = EmbedModel(hidden_size=4, normalize=False)
    np.testing.assert_allclose(raw.finish([3.0, 4.0, 12.0, 0.0], 4), [3.0, 4.0, 12.0, 0.0])
    with pytest.raises(Exception, match="not Matryoshka-trained"):
        raw.size(2)


def test_embeddings_and_rerank_refused_on_a_generating_model(scripted_server):
    url = f"http://127.0.0.1:{scripted_server.port}"
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_an_embedding_model"
    assert "model.task=embed" in r.json()["error"]["message"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": "a", "documents": ["b"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_a_score_model", (path, r.text)
