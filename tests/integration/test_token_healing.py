"""Token healing, best_of and diverse mode through real servers (tiny random Qwen2 with SmolLM2's
tokenizer, float32 on CPU), against transformers on the same weights:

- server.token_healing=true: a prompt ending mid-word ("... Fra") is served as transformers' greedy
  over the prompt less its last token, the first step restricted to tokens starting with that
  token's text; the returned text leaves that text out; a request's `token_healing: false` (and a
  server without the key) serves plain greedy; chat refuses the field.
- best_of=4, n=2 returns the two samples of the four with the highest cumulative logprob, best first,
  and counts all four in usage; the logprobs it ranks by are transformers'.
- router.diverse_mode=true: n samples of one prompt compute it once (the prefix-cache metrics), and
  still differ.
"""
from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from integration.conftest import CPU_BASE
from integration.server import LlaunchServer
from integration.test_prompt_cache import idle, metrics, wait_for

MODEL = "tiny-qwen2"
PROMPT = "The capital of Fra"  # SmolLM2's tokenizer ends it on " Fra"; "France" is one token " France"
MAX = 6
TIMEOUT = 120  # a first grammar compiles the vocabulary: seconds on a busy 2-core runner, past httpx's 5 s


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_dirs):
    base = CPU_BASE + ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}"]
    started = {name: LlaunchServer(base + extra, run_dir=tmp_path_factory.mktemp(f"run-{name}"))
               for name, extra in (("healing", ["server.token_healing=true"]),
                                   ("diverse", ["router.diverse_mode=true"]))}
    try:
        yield {name: s.wait_healthy() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(server, prompt, **kw):
    kw.setdefault("extra_body", {})
    kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True, **kw["extra_body"]}
    return client(server).completions.create(model=MODEL, prompt=prompt, **kw)


def healed_greedy(oracle, prompt_ids: list[int], max_new: int) -> tuple[list[int], str]:
    """The oracle: greedy over the prompt less its last token, the first token among those whose
    text starts with the last token's text."""
    tok = oracle.tokenizer
    prefix = tok.decode([prompt_ids[-1]])
    allowed = [i for i in range(len(tok)) if i not in tok.all_special_ids and tok.decode([i]).startswith(prefix)]
    logprobs = oracle.next_logprobs(prompt_ids[:-1])
    first = max(allowed, key=lambda i: logprobs[i].item())
    return [first] + oracle.greedy(prompt_ids[:-1] + [first], max_new - 1), prefix


def test_a_prompt_ending_mid_word_is_healed(servers, oracles):
    oracle = oracles("qwen2")
    ids = oracle.tokenizer.encode(PROMPT)
    expected, prefix = healed_greedy(oracle, ids, MAX)
    assert prefix == " Fra"
    out = complete(servers["healing"], PROMPT, max_tokens=MAX, temperature=0)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert oracle.tokenizer.decode(expected[:1]).startswith(prefix)
    assert choice.text == oracle.tokenizer.decode(expected)[len(prefix):]  # the prompt already has " Fra"
    assert choice.model_extra["prompt_token_ids"] == ids[:-1]

    generated = httpx.post(servers["healing"].url + "/generate", timeout=TIMEOUT,
                           json={"inputs": PROMPT, "parameters": {"max_new_tokens": MAX, "ignore_eos": True}}).json()
    assert generated["generated_text"] == [choice.text]


def test_without_healing_the_prompt_is_served_as_it_is(servers, oracles):
    oracle = oracles("qwen2")
    plain = oracle.greedy(oracle.tokenizer.encode(PROMPT), MAX)
    off = complete(servers["healing"], PROMPT, max_tokens=MAX, temperature=0, extra_body={"token_healing": False})
    default = complete(servers["diverse"], PROMPT, max_tokens=MAX, temperature=0)  # server.token_healing unset
    for out in (off, default):
        assert out.choices[0].model_extra["token_ids"] == plain
        assert out.choices[0].text == oracle.tokenizer.decode(plain)


def test_chat_refuses_token_healing(servers):
    r = httpx.post(servers["healing"].url + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "token_healing": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing"


def test_structured_output_is_not_healed(servers):
    """A grammar constrains the whole text, the backed-off prefix too: asking for both is a 400, and
    the server's default leaves a constrained request unhealed (its output follows the grammar)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_object"}}
    r = httpx.post(servers["healing"].url + "/v1/completions", timeout=TIMEOUT, json=body | {"token_healing": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing", r.text
    r = httpx.post(servers["healing"].url + "/v1/completions", timeout=TIMEOUT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].lstrip().startswith("{")


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(servers, oracles):
    oracle = oracles("qwen2")
    ids = oracle.tokenizer.encode("Once upon a time")
    common = dict(max_tokens=MAX, temperature=1.0, seed=11, logprobs=0)
    every = complete(servers["diverse"], ids, n=4, **common)  # seeds 11..14: best_of's four samples
    samples = []
    for c in every.choices:
        tokens, logprobs = c.model_extra["token_ids"], c.logprobs.token_logprobs
        for k, (token, lp) in enumerate(zip(tokens, logprobs)):  # the ranking's inputs are transformers'
            assert lp == pytest.approx(oracle.next_logprobs(ids + tokens[:k])[token].item(), abs=1e-3)
        samples.append((sum(logprobs), tokens))
    assert len({tuple(t) for _, t in samples}) > 1
    best = complete(servers["diverse"], ids, n=2, best_of=4, **common)
    ranked = [t for _, t in sorted(samples, key=lambda s: -s[0])]
    assert [c.model_extra["token_ids"] for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens == 4 * MAX

    r = httpx.post(servers["diverse"].url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def settled(server, quiet_s: float = 2.0, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once the server is idle and its cache counters have not moved for `quiet_s`: the
    router's stats reach /metrics a heartbeat (0.5 s) late, so an idle reading alone may predate the
    last requests of an earlier test."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        m = metrics(server)
        key = (m["prefix_cache_queries_total"], m["prefix_cache_hits_total"], idle(m))
        if key != last:
            last, since = key, time.monotonic()
        elif idle(m) and time.monotonic() - since >= quiet_s:
            return m
        time.sleep(0.1)
    raise AssertionError(f"the metrics did not settle: {last}")


def test_diverse_mode_prefills_a_prompt_once_for_all_its_samples(servers):
    prompt = list(range(1000, 1024))  # no earlier request shares any of it
    seen = {}
    for name in ("diverse", "healing"):
        before = settled(servers[name])
        out = complete(servers[name], prompt, n=4, max_tokens=MAX, temperature=1.0, seed=5,
                       extra_body={"token_healing": False})
        queries = before["prefix_cache_queries_total"] + 4 * len(prompt)
        after = wait_for(servers[name], lambda m: m["prefix_cache_queries_total"] == queries, f"{name}'s queries")
        seen[name] = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
        assert len({c.text for c in out.choices}) > 1  # kept apart by their seeds
    assert seen == {"diverse": 3 * (len(prompt) - 1), "healing": 0}  # diverse mode lends the first's prompt
