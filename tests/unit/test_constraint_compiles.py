"""Structured outputs compile in the frontend's compile processes under server.max_constraint_compile_s,
on the real frontend over HTTP (scripted engine): a spec the grammar engine refuses, or one that compiles
for longer than the budget, is a 400 naming its field; request parsing, plain requests and /tokenize
never wait behind compiles; a compile no client waits for is ended, so it delays nobody."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from unit.http_support import MODEL, smollm2_tokenizer
from unit.scripted_frontend import Server

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

SLOW = "(a|b|c|d|e|f|g|h)*"  # the regex: compile time grows steeply with its repetitions


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def slow_regex(k: int) -> str:
    return SLOW * k


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {"type": "wat"}}, "guided_json"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "n", "schema": {"type": "object", "patternProperties": {"a": {}}}}}},
     "response_format"),
    ("/generate", {"inputs": "x", "parameters": {"regular_constraint": "(ab"}}, "parameters.regular_constraint"),
    ("/generate", {"inputs": "x", "parameters": {"guided_grammar": "root ::= undefined_rule"}},
     "parameters.guided_grammar"),
])
def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(scripted_server, path, body, param):
    status, _, data = scripted_server.raw("POST", path, json.dumps(body).encode(),
                                          {"Content-Type": "application/json"})
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param, error
    assert not [m for m in scripted_server.engine.added() if m.sampling.constraint is not None
                and m.sampling.constraint.spec in json.dumps(body)], "a refused spec reached the engine"


def test_a_spec_over_the_budget_is_a_400_while_everything_else_answers_promptly(tok):
    """Six requests whose regex compiles for minutes, with plain completions and /tokenize beside them:
    each slow one is a 400 naming guided_regex after about the budget (or a 503 when no compile process
    took it within the budget: the others' held both), the plain ones answer within a second or two (they
    once waited 45 s behind compile threads); the same spec again is refused at once."""
    budget = 2.0
    srv = Server(tok, max_constraint_compile_s=budget)
    url = f"http://127.0.0.1:{srv.port}"
    slow: list[tuple[int, dict, float]] = []
    prompt: list[float] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def slow_one(k: int) -> None:
                t0 = time.monotonic()
                r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                     "guided_regex": slow_regex(k)})
                slow.append((r.status_code, r.json()["error"], time.monotonic() - t0))

            async def prompt_ones() -> None:
                await asyncio.sleep(0.3)  # the slow ones are compiling now
                for i in range(8):
                    for path, body in (("/v1/completions", {"model": MODEL, "prompt": f"plain {i}", "max_tokens": 3}),
                                       ("/tokenize", {"model": MODEL, "prompt": f"tokenize {i}"})):
                        t0 = time.monotonic()
                        r = await client.post(url + path, json=body)
                        assert r.status_code == 200, (path, r.text)
                        prompt.append(time.monotonic() - t0)
                    await asyncio.sleep(0.2)

            await asyncio.gather(*(slow_one(300 + k) for k in range(6)), prompt_ones())

    try:
        asyncio.run(run())
        assert len(slow) == 6
        for status, error, seconds in slow:
            assert (status, error["param"], error["code"]) == (400, "guided_regex", "constraint_too_complex") \
                or (status, error["code"]) == (503, "compilers_busy"), error
            assert seconds < 3 * budget + 2, seconds  # its wait for a process, then its own budget
        assert sum(s == 400 for s, _, _ in slow) >= 2
        assert max(prompt) < 2.0, sorted(prompt)[-5:]
        t0 = time.monotonic()
        status, _, data = srv.raw("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x", "guided_regex": slow_regex(300)}).encode())
        assert status == 400 and json.loads(data)["error"]["param"] == "guided_regex"
        assert time.monotonic() - t0 < 0.5  # remembered: it costs nothing the second time
    finally:
        srv.stop()


def test_a_compile_no_client_waits_for_is_abandoned(tok):
    """Two clients give up on slow specs (both compile processes busy): their compiles are ended, so a
    structured request right after compiles at once instead of waiting out their 60 s budget."""
    srv = Server(tok, max_constraint_compile_s=60.0)
    url = f"http://127.0.0.1:{srv.port}"
    try:
        for k in (400, 401):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": slow_regex(k)},
                           timeout=1.0)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                     "guided_regex": "(maybe|so)"}, timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 10, "the abandoned compiles held the compile processes"
    finally:
        srv.stop()
