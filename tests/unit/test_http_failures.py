"""Failures a client meets half-way, on the real frontend over HTTP with a scripted engine: a stream
cut by an internal error ends with its dialect's error event (OpenAI's then `[DONE]`), and every 503
(not ready, draining) carries Retry-After."""
from __future__ import annotations

import json

import pytest

from llaunch.runtime.http import engine_client

from unit.http_support import MODEL, smollm2_tokenizer, wait_for
from unit.scripted_frontend import Server

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture
def broken_after_one_delta(monkeypatch):
    """A bug that surfaces after a stream's first chunk: the request group's iteration raises."""
    real = engine_client.RequestGroup.__aiter__

    async def breaks(self):
        async for item in real(self):
            yield item
            raise RuntimeError("boom")

    monkeypatch.setattr(engine_client.RequestGroup, "__aiter__", breaks)


def events(data: bytes) -> list[str]:
    return [line for line in data.decode().split("\n") if line]


def test_openai_and_lightllm_streams_cut_by_an_internal_error_end_with_an_error_event(
        scripted_server, broken_after_one_delta):
    status, _, data = scripted_server.raw("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}).encode())
    lines = events(data)
    assert status == 200 and lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "internal_error" and "boom" in error["message"] and error["type"] == "server_error"
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"]  # the chunk before the failure came

    status, _, data = scripted_server.raw("POST", "/generate_stream", json.dumps(
        {"inputs": "x", "parameters": {"max_new_tokens": 8}}).encode())
    lines = events(data)
    assert status == 200 and len(lines) == 2 and json.loads(lines[0][len("data:"):])["token"]["text"]
    assert json.loads(lines[-1][len("data:"):])["error"]["code"] == "internal_error"
    wait_for(lambda: scripted_server.lifecycle.in_flight == 0)  # the failed requests were closed


def test_a_tgi_stream_cut_by_an_internal_error_ends_with_tgi_s_error_event(tok, broken_after_one_delta):
    srv = Server(tok, tgi_info={"model_id": MODEL})
    try:
        status, _, data = srv.raw("POST", "/generate_stream", json.dumps(
            {"inputs": "x", "parameters": {"max_new_tokens": 8}}).encode())
        lines = events(data)
        assert status == 200
        last = json.loads(lines[-1][len("data:"):])
        assert last["error_type"] == "generation" and "boom" in last["error"], lines
    finally:
        srv.stop()


def test_every_503_carries_retry_after(tok):
    srv = Server(tok)
    try:
        srv.engine.heartbeat = False  # no heartbeat: not ready
        wait_for(lambda: srv.raw("GET", "/health/ready")[0] == 503)
        for path in ("/health/ready", "/health", "/readiness", "/healthz"):
            conn_status, headers = head_of(srv, path)
            assert conn_status == 503 and headers.get("Retry-After") == "1", path
        srv.engine.heartbeat = True
        wait_for(lambda: srv.raw("GET", "/health/ready")[0] == 200)
        assert "Retry-After" not in head_of(srv, "/health/ready")[1]
        stream = srv.openai().completions.create(model=MODEL, prompt="slow", max_tokens=12, stream=True)
        next(iter(stream))  # in flight: the drain waits for it
        srv.loop.call_soon_threadsafe(srv.lifecycle.drain, 10.0)
        wait_for(lambda: srv.lifecycle.draining)
        status, headers = head_of(srv, "/v1/completions", b'{"prompt": "x"}')
        assert status == 503 and headers.get("Retry-After") == "1"  # a drain's 503 had none
        list(stream)
    finally:
        srv.stop()


def head_of(srv: Server, path: str, body: bytes | None = None):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST" if body else "GET", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, resp.headers  # case-insensitive


def test_readiness_fails_while_request_parsing_is_backed_up(tok):
    """The threads that parse requests busy with a backlog (here: sleeps standing for huge prompts being
    tokenized): /health/ready says 503 frontend_busy until a no-op runs there within parse_probe_s, then 200.
    It once said 200 while parsing waited 45 s behind grammar compiles."""
    import asyncio
    import time

    srv = Server(tok, parse_probe_s=0.5)
    try:
        def backlog() -> None:
            for _ in range(24):  # four rounds of the default executor's threads (min(32, cores + 4))
                asyncio.ensure_future(asyncio.to_thread(time.sleep, 1.5))

        srv.loop.call_soon_threadsafe(backlog)
        answers = []
        wait_for(lambda: answers.append(srv.raw("GET", "/health/ready")) or answers[-1][0] == 503, timeout=3)
        assert json.loads(answers[-1][2])["error"]["code"] == "frontend_busy"
        assert srv.raw("GET", "/health/live")[0] == 200
        wait_for(lambda: srv.raw("GET", "/health/ready")[0] == 200, timeout=30)
    finally:
        srv.stop()
