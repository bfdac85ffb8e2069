"""The OpenAPI schema at /openapi.json, fuzzed with schemathesis against the real CPU server: every
generated request (valid and invalid, boundary values included) gets an answer below 500, no
process crashes, and afterwards the server answers a reference request exactly as before."""
from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from integration.conftest import start_server
from integration.test_api import wait_idle

MODEL = "tiny-qwen2"
# Small enough that a valid request generates little: a short context, few completions per request.
LIMITS = ["model.max_model_len=64", "server.max_choices_per_request=8", "server.max_prompts_per_request=8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    overrides = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}", *LIMITS]
    with start_server(tmp_path_factory, "openapi", overrides) as s:
        yield s


def reference(server) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Reference:", "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_schema_describes_the_routes_with_their_bounds(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate",
            "/health/ready"} <= set(doc["paths"])
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]
    assert messages == {"$ref": "#/components/schemas/AnthropicErrorBody"}  # Anthropic's error shape there
    assert doc["components"]["schemas"]["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 64
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert "additionalProperties" not in completion  # server.unknown_fields=warn: other fields are served
    temperature = completion["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 100.0)


def test_fuzzing_the_api_finds_no_server_error(server, tmp_path):
    before = reference(server)
    cli = shutil.which("schemathesis", path=str(__import__("pathlib").Path(sys.executable).parent))
    # One worker: on CPython 3.11, ast.parse in two threads at once (hypothesis describing its lambdas)
    # can raise "SystemError: AST constructor recursion depth mismatch", which failed a CI run.
    run = subprocess.run(
        [cli, "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "100",
         "--phases", "coverage,fuzzing", "--request-timeout", "120", "--workers", "1", "--seed", "1",
         "--generation-database", "none", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache stays out of the checkout
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    generated = int(run.stdout.split(" generated, ")[0].rsplit("\n", 1)[1].strip())
    assert generated >= 500 and f"{generated} passed" in run.stdout, run.stdout[-3000:]
    assert server.proc.poll() is None and len(server.children()) == 4  # nothing crashed
    assert reference(server) == before
    assert httpx.get(server.url + "/health").json()["running"] == 0
    wait_idle(server)
