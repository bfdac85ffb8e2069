"""Prompt logprobs through the real HTTP API (tiny random Qwen2, float32, CPU): OpenAI completions'
echo + logprobs, vLLM's prompt_logprobs (completions and chat) and LightLLM's /generate under
server.return_all_prompt_logprobs all equal transformers' log-softmax over the prompt. Prompts are
longer than router.chunked_prefill_size, so their logits come from several chunks; the prompt cache
is on, so a repeated prompt (its prefix cached) must still return every logprob."""
from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from fixtures.tiny_models import model_config_from_folder
from integration.conftest import start_server
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.runner import ModelRunner

MODEL = "tiny-qwen2"
CHUNK = 8  # router.chunked_prefill_size: every prompt below spans several chunks
ATOL = 1e-3
RANK_TIE = 1e-5  # float32 noise between two summation orders: ~1e-6 on these logprobs (~-11)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    with start_server(tmp_path_factory, "prompt-logprobs",
                      ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}",
                       f"router.chunked_prefill_size={CHUNK}", "server.return_all_prompt_logprobs=true"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle(oracles):
    return oracles("qwen2")


def reference(oracle, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row i is the distribution of token i+1."""
    with torch.inference_mode():
        logits = oracle.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def chosen(ref: torch.Tensor, ids: list[int]) -> list[float]:
    return ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def test_mixed_batches_in_process(tiny_dirs, oracle):
    """Scheduler and model runner in one process, results two steps late (as the worker pipelines):
    requests that ask and requests that do not share chunked steps; each asker's logprobs equal
    transformers', the others' tokens are transformers' greedy ones, and a repeated prompt (cached
    prefix) still gets all of its logprobs."""
    model = build_model(model_config_from_folder(tiny_dirs["qwen2"]), device=torch.device("cpu"), dtype=torch.float32)
    sched = Scheduler(SchedulerLimits(kv_slots=600, max_running=4, batch_max_tokens=24, chunked_prefill=True,
                                      chunked_prefill_size=CHUNK, max_wait_tokens=2, token_ratio=0.0, max_model_len=256,
                                      eos_ids=(), pipeline_depth=2, prompt_cache=True))
    runner = ModelRunner(model, model.make_kv_cache(601, 5, 256), 4, torch.device("cpu"))
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (30, 1, 17, 9, 40)]
    prompts += [prompts[0], prompts[2]]  # their prefixes are cached by then
    wants = [0, 1, -1, 0, -1, 2, -1]
    jobs = {f"r{i}": (p, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k))
            for i, (p, k) in enumerate(zip(prompts, wants))}
    tokens = {rid: [] for rid in jobs}
    got, results = {}, []
    for wave in (list(jobs)[:5], list(jobs)[5:]):  # the second wave's prompts are in the prompt cache
        for rid in wave:
            p, sp = jobs[rid]
            sched.add(Request(AddRequest(request_id=rid, frontend=0, prompt_ids=p, sampling=sp, arrival_time=0.0), sp))
        while sched.has_work() or results:
            while len(results) < 2 and (plan := sched.schedule()) is not None:
                results.append(runner.execute(plan))
            for delta in sched.on_result(results.pop(0)):
                tokens[delta.request_id] += delta.token_ids
                if delta.prompt_logprobs is not None:
                    assert delta.request_id not in got
                    got[delta.request_id] = delta.prompt_logprobs
        hits = sched.cache.hits
    assert hits >= len(prompts[2]) - 1  # r6 reused its prefix; r5 would have
    for rid, (p, sp) in jobs.items():
        assert tokens[rid] == oracle.greedy(p, 3)
        if sp.prompt_logprobs < 0:
            assert rid not in got
            continue
        ref = reference(oracle, p)
        assert got[rid].logprobs == pytest.approx(chosen(ref, p) if len(p) > 1 else [], abs=ATOL)
        assert all(rank in ranks_within(row, t) for rank, row, t in zip(got[rid].ranks, ref, p[1:], strict=True))
        if sp.prompt_logprobs:
            assert got[rid].top_ids == [row.topk(sp.prompt_logprobs).indices.tolist() for row in ref]


def ranks_within(row: torch.Tensor, token: int, tol: float = RANK_TIE) -> range:
    """The ranks `token` may take in `row` (transformers' log-softmax): a logit within float32 noise of the
    token's may fall on either side of it in a different summation order."""
    return range(int((row > row[token] + tol).sum()) + 1, int((row > row[token] - tol).sum()) + 2)


def prompt_text(oracle, words: int) -> str:
    text = " ".join(f"w{i} alpha beta" for i in range(words))
    assert len(oracle.tokenizer.encode(text)) > 2 * CHUNK
    return text


def test_echo_with_logprobs_equals_transformers(client, oracle):
    text = prompt_text(oracle, 8)
    ids = oracle.tokenizer.encode(text)
    ref = reference(oracle, ids)
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(text)
    n = len(ids)
    assert lp.tokens[:n] == [oracle.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(chosen(ref, ids), abs=ATOL)
    for i in range(1, n):  # the top 2 of each position's distribution
        vals, top = ref[i - 1].topk(2)
        want = {oracle.tokenizer.decode([t]): v for t, v in zip(top.tolist(), vals.tolist())}
        assert lp.top_logprobs[i] == pytest.approx(want, abs=ATOL)
    assert len(lp.tokens) == n + 3  # then the generated tokens
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[n] >= len(text)


def test_echo_streamed_carries_prompt_logprobs(client, oracle):
    text = prompt_text(oracle, 6)
    ids = oracle.tokenizer.encode(text)
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    got = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert got[0] is None
    assert got[1:len(ids)] == pytest.approx(chosen(reference(oracle, ids), ids), abs=ATOL)


def test_echo_streamed_with_two_samples_leads_each_with_prompt_logprobs(client, oracle):
    """Only the first sample computes them: the second's chunks wait for them, and still open with them."""
    text = prompt_text(oracle, 7)
    ids = oracle.tokenizer.encode(text)
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True, logprobs=0, n=2,
                                            temperature=1.0, seed=3, stream=True))
    for index in range(2):
        got = [v for c in chunks for ch in c.choices if ch.index == index and ch.logprobs
               for v in ch.logprobs.token_logprobs]
        assert got[0] is None and len(got) == len(ids) + 2
        assert got[1:len(ids)] == pytest.approx(chosen(reference(oracle, ids), ids), abs=ATOL)


def test_vllm_prompt_logprobs_on_completions_twice(client, oracle):
    """The second request's prefix is in the prompt cache: it still gets every prompt logprob."""
    text = prompt_text(oracle, 9)
    ids = oracle.tokenizer.encode(text)
    ref = reference(oracle, ids)
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0,
                                        extra_body={"prompt_logprobs": 3})
        plp = out.choices[0].model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for i, token in enumerate(ids[1:], start=1):
            entry = plp[i]
            row = ref[i - 1]
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=ATOL)
            assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
            vals, top = row.topk(3)
            for rank, (t, v) in enumerate(zip(top.tolist(), vals.tolist()), start=1):
                assert entry[str(t)]["logprob"] == pytest.approx(v, abs=ATOL)
                assert entry[str(t)]["decoded_token"] == oracle.tokenizer.decode([t])
                if t != token:
                    assert entry[str(t)]["rank"] == rank
            assert len(entry) == 3 + (token not in top.tolist())
    # without asking, the same prompt now reuses its cached prefix
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0


def test_the_samples_of_a_prompt_share_its_prompt_logprobs(client, oracle):
    """n=2 of best_of=3 samples (only the first computes the prompt's logprobs: the others get its): every
    choice returned carries them, as its vLLM prompt_logprobs and as its echo's logprobs."""
    text = prompt_text(oracle, 5)
    ids = oracle.tokenizer.encode(text)
    ref = chosen(reference(oracle, ids), ids)
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=2, n=2, best_of=3, echo=True, logprobs=1,
                                    temperature=1.0, seed=11, extra_body={"prompt_logprobs": 1})
    assert len(out.choices) == 2
    for choice in out.choices:
        plp = choice.model_extra["prompt_logprobs"]
        assert [plp[i][str(t)]["logprob"] for i, t in enumerate(ids[1:], start=1)] == pytest.approx(ref, abs=ATOL)
        assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=ATOL)


def test_vllm_prompt_logprobs_on_chat(client, oracle):
    messages = [{"role": "user", "content": prompt_text(oracle, 7)}]
    ids = list(oracle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    plp = out.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = [plp[i][str(t)]["logprob"] for i, t in enumerate(ids[1:], start=1)]
    assert got == pytest.approx(chosen(reference(oracle, ids), ids), abs=ATOL)


def test_prompt_logprobs_with_stream_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_generate_returns_all_prompt_logprobs(server, oracle):
    text = prompt_text(oracle, 8)
    ids = oracle.tokenizer.encode(text)
    ref = chosen(reference(oracle, ids), ids)
    for _ in range(2):  # the second time its prefix is cached
        r = httpx.post(server.url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 2}},
                       timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prompt_token_ids"] == ids
        pairs = body["prompt_logprobs"]
        assert [p[0] for p in pairs] == ids[:-1]
        assert [list(p[1]) for p in pairs] == [[str(t)] for t in ids[1:]]
        assert [next(iter(p[1].values())) for p in pairs] == pytest.approx(ref, abs=ATOL)
