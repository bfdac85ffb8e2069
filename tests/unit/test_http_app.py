"""The frontend end to end over real HTTP: a real Hypercorn server on a free 127.0.0.1 port, the
official `openai` client, and a scripted router/detokenizer behind the real EngineClient
(unit/scripted_frontend.py)."""
from __future__ import annotations

import http.client
import json

import openai
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.ipc.messages import SamplingParams

from unit.http_support import METRICS_TEXT, MODEL, REPLY, reply_text, smollm2_tokenizer, wait_for
from unit.scripted_frontend import LIMITS, Server


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(scripted_server):
    return scripted_server


def test_completion_non_stream(server, tok):
    out = server.openai().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.text == reply_text(tok, 5) and choice.finish_reason == "length" and choice.index == 0
    prompt_len = len(tok.hf.encode("Once upon a time"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_len, 5, prompt_len + 5)
    req = server.engine.added()[-1]
    assert req.prompt_ids == tok.hf.encode("Once upon a time") and req.sampling.greedy


def test_completion_stream_with_usage(server, tok):
    chunks = list(server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=64, stream=True,
                                                     stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == REPLY
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "stop"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(text_chunks)
    assert len({c.id for c in chunks}) == 1


def test_completion_n_and_prompt_list(server, tok):
    out = server.openai().completions.create(model=MODEL, prompt=["A", "B"], n=3, seed=7, max_tokens=3)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.text == reply_text(tok, 3) for c in out.choices)
    added = server.engine.added()[-6:]
    assert [r.sampling.seed for r in added] == [7, 8, 9, 7, 8, 9]
    assert out.usage.prompt_tokens == len(tok.hf.encode("A")) + len(tok.hf.encode("B"))
    assert out.usage.completion_tokens == 18
    assert len({r.request_id for r in added}) == 6 and all(r.request_id.startswith("0-") for r in added)


def test_completion_logprobs_shape(server, tok):
    out = server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    ids = tok.hf.encode(REPLY, add_special_tokens=False)[:4]
    assert lp.tokens == [tok.hf.decode([i]) for i in ids]
    assert lp.token_logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert lp.top_logprobs[0] == {tok.hf.decode([ids[0]]): -0.25, tok.hf.decode([ids[0] + 1]): -1.25}
    assert lp.text_offset == [0] + [len("".join(lp.tokens[:k])) for k in range(1, 4)]


def test_chat_non_stream_with_logprobs(server, tok):
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3, logprobs=True, top_logprobs=2)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == reply_text(tok, 3)
    ids = tok.hf.encode(REPLY, add_special_tokens=False)[:3]
    content = choice.logprobs.content
    assert [c.token for c in content] == [tok.hf.decode([i]) for i in ids]
    assert [bytes(c.bytes).decode() for c in content] == [c.token for c in content]
    assert [len(c.top_logprobs) for c in content] == [2, 2, 2] and content[1].top_logprobs[1].logprob == -1.5
    chat_ids = tok.hf.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    assert server.engine.added()[-1].prompt_ids == list(chat_ids)
    assert out.usage.prompt_tokens == len(chat_ids)


def test_chat_stream_n2(server, tok):
    chunks = list(server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=2, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == reply_text(tok, 4)
        assert mine[-1].finish_reason == "length"


def test_chat_stream_logprobs_and_usage(server, tok):
    chunks = list(server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=3, logprobs=True,
        top_logprobs=1, stream=True, stream_options={"include_usage": True}))
    content = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    ids = tok.hf.encode(REPLY, add_special_tokens=False)[:3]
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in content] == [
        (tok.hf.decode([i]), -0.25 * (k + 1), 1) for k, i in enumerate(ids)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_completion_echo(server, tok):
    out = server.openai().completions.create(model=MODEL, prompt="Echo me", max_tokens=2, echo=True)
    assert out.choices[0].text == "Echo me" + reply_text(tok, 2)


def test_stop_string_aborts_at_the_router(server, tok):
    out = server.openai().completions.create(model=MODEL, prompt="stopword", max_tokens=10)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == reply_text(tok, 3)
    request_id = server.engine.added()[-1].request_id
    wait_for(lambda: request_id in server.engine.aborted())


def test_engine_failure_is_an_error(server):
    with pytest.raises(openai.InternalServerError):
        server.openai().completions.create(model=MODEL, prompt="broken", max_tokens=10)
    with pytest.raises(openai.APIError):
        list(server.openai().completions.create(model=MODEL, prompt="broken", max_tokens=10, stream=True))
    assert server.raw("GET", "/v1/models")[0] == 200  # still serving


def test_client_disconnect_aborts(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 100, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    request_id = server.engine.added()[-1].request_id
    conn.close()
    wait_for(lambda: request_id in server.engine.aborted())
    wait_for(lambda: server.client.running == 0 and server.lifecycle.in_flight == 0)
    # Non-streaming: the client gives up while the engine has not answered.
    with pytest.raises(openai.APITimeoutError):
        server.openai().with_options(timeout=0.5).completions.create(model=MODEL, prompt="hang", max_tokens=3)
    request_id = server.engine.added()[-1].request_id
    wait_for(lambda: request_id in server.engine.aborted())


def test_least_loaded_replica(server, tok):
    async def three_hanging_requests():
        hang = tok.hf.encode("hang")
        groups = [await server.client.submit([(hang, SamplingParams(max_new_tokens=4))]) for _ in range(3)]
        load = list(server.client.outstanding)
        for group in groups:
            await group.abort()
        return [g.replica for g in groups], load, list(server.client.outstanding)

    replicas, load, after = server.run(three_hanging_requests())
    assert replicas == [0, 1, 0] and load == [2, 1] and after == [0, 0]


def test_lightllm_generate(server, tok):
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 3, "return_details": True}}).encode()
    status, _, data = server.raw("POST", "/generate", body)
    out = json.loads(data)
    ids = tok.hf.encode(REPLY, add_special_tokens=False)[:3]
    assert status == 200 and out["generated_text"] == [reply_text(tok, 3)]
    assert (out["count_output_tokens"], out["finish_reason"], out["prompt_tokens"]) == (3, "length", 1)
    assert [t["id"] for t in out["tokens"]] == ids and out["tokens"][1]["logprob"] == -0.5
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "n": 2, "best_of": 2,
                                                      "do_sample": True}}).encode()
    out = json.loads(server.raw("POST", "/generate", body)[2])
    assert out["count_output_tokens"] == [2, 2] and out["finish_reason"] == ["length", "length"]


def test_lightllm_generate_images_on_a_text_model_are_400(server):
    image = {"type": "base64", "data": "aGk="}
    body = json.dumps({"inputs": "Hi", "multimodal_params": {"images": [image]}}).encode()
    status, _, data = server.raw("POST", "/generate", body)
    assert status == 400 and json.loads(data)["error"]["param"] == "multimodal_params.images"
    empty = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 1}, "multimodal_params": {"images": []}})
    assert server.raw("POST", "/generate", empty.encode())[0] == 200  # LightLLM clients send it empty


def test_lightllm_generate_stream(server, tok):
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 3}}).encode()
    status, ctype, data = server.raw("POST", "/generate_stream", body)
    events = [json.loads(line[len(b"data:"):]) for line in data.split(b"\n\n") if line]
    assert status == 200 and ctype.startswith("text/event-stream")
    assert [e["token"]["count_output_tokens"] for e in events] == [1, 2, 3]
    assert "".join(e["token"]["text"] for e in events) == reply_text(tok, 3)
    assert [e["finished"] for e in events] == [False, False, True] and events[-1]["finish_reason"] == "length"
    assert set(events[0]) == {"token", "generated_text", "finished", "finish_reason", "details"}


def test_models_health_metrics(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].max_model_len == LIMITS.max_model_len
    assert server.raw("GET", "/health")[0] == 200
    status, ctype, data = server.raw("GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4") and data.decode().startswith(METRICS_TEXT)
    from prometheus_client.parser import text_string_to_metric_families

    # then this frontend's own process series (vLLM's API server exposes them too)
    process = {f.name: f for f in text_string_to_metric_families(data.decode()[len(METRICS_TEXT):])}
    assert process["process_resident_memory_bytes"].samples[0].value > 10 << 20
    assert process["process_cpu_seconds"].samples[0].value > 0
    server.engine.heartbeat = False
    try:
        wait_for(lambda: server.raw("GET", "/health")[0] == 503, timeout=3)
    finally:
        server.engine.heartbeat = True
    wait_for(lambda: server.raw("GET", "/health")[0] == 200)


def test_bad_requests_over_http(server):
    for body, status in [(b"{oops", 400), (b'{"model": "nope", "prompt": "x"}', 404),
                         (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 500}', 400),
                         (b'{"model": "smollm2-135m", "prompt": "x", "n": 99}', 400)]:
        got, ctype, data = server.raw("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        error = json.loads(data)["error"]
        assert got == status and ctype == "application/json" and set(error) == {"message", "type", "param", "code"}
    assert "500" in json.loads(server.raw("POST", "/v1/completions",
                                          b'{"prompt": "x", "max_tokens": 500}')[2])["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.openai().completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError):
        server.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)
    assert server.raw("GET", "/no/such/route")[0] == 404
    # /tokenize refuses a role the chat route refuses (it once rendered it through the template)
    got, _, data = server.raw("POST", "/tokenize", b'{"messages": [{"role": "bogus", "content": "x"}]}',
                              {"Content-Type": "application/json"})
    assert got == 400 and json.loads(data)["error"]["param"] == "messages[0].role"
    assert server.raw("GET", "/v1/completions")[0] == 405
    assert server.openai().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text


def test_api_key(tok):
    srv = Server(tok, api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.openai("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert srv.raw("GET", "/v1/models")[0] == 401 and srv.raw("GET", "/metrics")[0] == 401
        assert srv.raw("GET", "/health")[0] == 200
        assert srv.openai("sekret").completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
    finally:
        srv.stop()


def test_drain_finishes_running_requests_and_refuses_new_ones(tok):
    srv = Server(tok)
    try:
        stream = srv.openai().completions.create(model=MODEL, prompt="slow", max_tokens=12, stream=True)
        first = next(iter(stream))
        srv.loop.call_soon_threadsafe(srv.lifecycle.drain, 10.0)
        wait_for(lambda: srv.lifecycle.draining)
        status, _, data = srv.raw("POST", "/v1/completions", b'{"prompt": "x"}')
        assert status == 503 and json.loads(data)["error"]["code"] == "draining"
        assert srv.raw("GET", "/health")[0] == 503
        rest = list(stream)  # the running request still finishes
        assert first.choices[0].text + "".join(c.choices[0].text for c in rest) == reply_text(tok, 12, repeats=20)
        srv.thread.join(10)
        assert not srv.thread.is_alive()  # drained: the server stopped by itself
    finally:
        srv.stop()
