"""The OpenAI-compatible API through the whole graph (tiny random Qwen2 on CPU): concurrency,
streaming, sampling options, stop strings, n, seeds, bad requests, and KV accounting afterwards."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from integration.conftest import start_server

MODEL = "tiny-qwen2"


def api(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^llaunch:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"metric llaunch:{name} missing"
    return sum(values)


def wait_idle(server, timeout=10.0):
    """KV usage and running/waiting gauges back to zero (the metrics lag the router a little)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(server, "kv_cache_usage_perc") == 0 and metric(server, "num_requests_running") == 0
                and metric(server, "num_requests_waiting") == 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"not idle: kv={metric(server, 'kv_cache_usage_perc')} "
                         f"running={metric(server, 'num_requests_running')}")


def test_models_and_health(tiny_qwen2_server):
    models = api(tiny_qwen2_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(tiny_qwen2_server.url + "/health").status_code == 200


def test_32_concurrent_streams_match_non_stream_and_free_all_kv(tiny_qwen2_server):
    client = AsyncOpenAI(base_url=tiny_qwen2_server.url + "/v1", api_key="none", max_retries=0)

    async def stream(i):
        chunks = []
        s = await client.completions.create(model=MODEL, prompt="word " * (1 + 3 * i), max_tokens=4 + i % 13,
                                            temperature=0.8, seed=1000 + i, stream=True)
        finish = None
        async for c in s:
            chunks.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
        return "".join(chunks), finish

    async def run_all():
        return await asyncio.gather(*(stream(i) for i in range(32)))

    results = asyncio.run(run_all())
    sync = api(tiny_qwen2_server)
    for i, (text, finish) in enumerate(results):
        assert finish in ("stop", "length")
        ref = sync.completions.create(model=MODEL, prompt="word " * (1 + 3 * i), max_tokens=4 + i % 13,
                                      temperature=0.8, seed=1000 + i)
        assert text == ref.choices[0].text, f"stream {i} differs from the non-stream result"
    wait_idle(tiny_qwen2_server)


def test_seed_reproducible_and_different_seeds_differ(tiny_qwen2_server):
    c = api(tiny_qwen2_server)

    def run(seed):
        return c.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=seed,
                                    extra_body={"ignore_eos": True}).choices[0].text

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_max_tokens_and_length_finish(tiny_qwen2_server):
    out = api(tiny_qwen2_server).completions.create(model=MODEL, prompt="a b c", max_tokens=5, temperature=0,
                                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_stop_string_is_not_returned(tiny_qwen2_server):
    c = api(tiny_qwen2_server)
    full = c.completions.create(model=MODEL, prompt="x y z", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = c.completions.create(model=MODEL, prompt="x y z", max_tokens=24, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="x y z", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == full[: full.index(stop)]
    wait_idle(tiny_qwen2_server)


def test_n_choices_with_seed_differ_and_are_reproducible(tiny_qwen2_server):
    c = api(tiny_qwen2_server)
    a = c.completions.create(model=MODEL, prompt="Hi", n=3, max_tokens=8, temperature=1.0, seed=5)
    b = c.completions.create(model=MODEL, prompt="Hi", n=3, max_tokens=8, temperature=1.0, seed=5)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)] == \
        [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert len({ch.text for ch in a.choices}) > 1


def test_stream_usage_and_chat_stream(tiny_qwen2_server):
    c = api(tiny_qwen2_server)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}, temperature=0))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert 1 <= chunks[-1].usage.completion_tokens <= 6
    assert chunks[0].choices[0].delta.role == "assistant"
    assert any(ch.choices and ch.choices[0].finish_reason in ("stop", "length") for ch in chunks)


def test_penalties_change_output_and_stay_valid(tiny_qwen2_server):
    c = api(tiny_qwen2_server)
    base = c.completions.create(model=MODEL, prompt="the the the", max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True})
    pen = c.completions.create(model=MODEL, prompt="the the the", max_tokens=16, temperature=0,
                               frequency_penalty=2.0, presence_penalty=1.0,
                               extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert pen.usage.completion_tokens == 16
    assert pen.choices[0].text != base.choices[0].text


@pytest.mark.parametrize("body, status", [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": "x", "max_tokens": "five"}, 400),
    ({"model": "no-such-model", "prompt": "x"}, 404),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ({"model": MODEL, "prompt": "x " * 600, "max_tokens": 4}, 400),  # longer than the 512-token context
    ({"model": MODEL}, 400),
])
def test_bad_requests_get_4xx_json_and_server_keeps_serving(tiny_qwen2_server, body, status):
    r = httpx.post(tiny_qwen2_server.url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and "type" in err
    ok = api(tiny_qwen2_server).completions.create(model=MODEL, prompt="still", max_tokens=2)
    assert ok.choices[0].text is not None


def test_malformed_json_gets_400(tiny_qwen2_server):
    r = httpx.post(tiny_qwen2_server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_generate_endpoints_lightllm_shapes(tiny_qwen2_server):
    r = httpx.post(tiny_qwen2_server.url + "/generate",
                   json={"inputs": "hello", "parameters": {"max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body["generated_text"], list) and body["count_output_tokens"] == 5
    with httpx.stream("POST", tiny_qwen2_server.url + "/generate_stream",
                      json={"inputs": "hello", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert len(events) >= 3


def test_api_key_required_except_health(tmp_path_factory, tiny_dirs):
    overrides = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}", "server.api_key=sekret"]
    with start_server(tmp_path_factory, "apikey", overrides) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(server.url + "/metrics").status_code == 401
        ok = OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_two_http_workers_each_get_their_own_results(tmp_path_factory, tiny_dirs):
    overrides = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}", "server.http_workers=2"]
    with start_server(tmp_path_factory, "two-frontends", overrides) as server:
        assert len(server.children()) == 5
        async def one(i):
            # a fresh connection per request, so the kernel spreads them over both frontends
            async with httpx.AsyncClient() as http:
                r = await http.post(server.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"p{i} " * (i + 1), "max_tokens": 6,
                                          "temperature": 0, "return_token_ids": True})
            return r.json()["choices"][0]

        async def run_all():
            return await asyncio.gather(*(one(i) for i in range(16)))

        got = asyncio.run(run_all())
        for i, choice in enumerate(got):
            ref = api(server).completions.create(model=MODEL, prompt=f"p{i} " * (i + 1), max_tokens=6, temperature=0)
            assert choice["text"] == ref.choices[0].text
        assert len(list((server.run_dir / "logs").glob("frontend.*.log"))) == 2
