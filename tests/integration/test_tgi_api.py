"""server.tgi_api: text-generation-inference's API through huggingface_hub's InferenceClient (it posts to
the base URL, TGI's compat route), /generate, /generate_stream and /info; greedy tokens and logprobs
equal transformers'. The same server sets server.api_key and server.metrics_port: the metric server's
own listener answers without the key, with the series the API port's /metrics has."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError
from prometheus_client.parser import text_string_to_metric_families

from integration.conftest import CPU_BASE, start_server
from integration.server import REPO, free_port

pytestmark = pytest.mark.timeout(600)
KEY = "tgi-sekret"
PROMPTS = ["The quick brown fox", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tgi_server(tmp_path_factory, tiny_dirs):
    metrics_port = free_port()
    overrides = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", "model.name=tiny-qwen2", "server.tgi_api=true",
                 f"server.api_key={KEY}", f"server.metrics_port={metrics_port}"]
    with start_server(tmp_path_factory, "tgi", overrides) as server:
        server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield server


def hf(server) -> InferenceClient:
    return InferenceClient(base_url=server.url, api_key=KEY)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def greedy_ids(oracle, prompt: str, max_new: int) -> list[int]:
    eos = set(oracle.model.config.eos_token_id if isinstance(oracle.model.config.eos_token_id, list)
              else [oracle.model.config.eos_token_id])
    want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], max_new)
    for i, t in enumerate(want):
        if t in eos:
            return want[: i + 1]
    return want


def test_text_generation_details_greedy_equals_transformers(tgi_server, oracles):
    oracle = oracles("qwen2")
    for prompt in PROMPTS:
        want = greedy_ids(oracle, prompt, 8)
        out = hf(tgi_server).text_generation(prompt, max_new_tokens=8, details=True)
        assert [t.id for t in out.details.tokens] == want, prompt
        assert out.generated_text == oracle.tokenizer.decode(want, skip_special_tokens=True)
        assert out.details.generated_tokens == len(want)
        assert out.details.finish_reason == ("length" if len(want) == 8 else "eos_token")
        assert out.details.seed is None  # greedy
        first = oracle.next_logprobs(oracle.tokenizer(prompt)["input_ids"])[want[0]].item()
        assert out.details.tokens[0].logprob == pytest.approx(first, abs=1e-3)
        # details=False: the text alone; return_full_text prepends the prompt
        assert hf(tgi_server).text_generation(prompt, max_new_tokens=8) == out.generated_text
        full = hf(tgi_server).text_generation(prompt, max_new_tokens=8, return_full_text=True)
        assert full == prompt + out.generated_text


def test_text_generation_stream_matches_the_whole_answer(tgi_server, oracles):
    oracle = oracles("qwen2")
    prompt = PROMPTS[0]
    want = greedy_ids(oracle, prompt, 8)
    client = hf(tgi_server)  # held: the client closes its connection (and the stream) when collected
    events = list(client.text_generation(prompt, max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == want
    assert [e.generated_text for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].generated_text == "".join(e.token.text for e in events)
    assert events[-1].generated_text == oracle.tokenizer.decode(want, skip_special_tokens=True)
    assert events[-1].details.generated_tokens == len(want)
    assert events[-1].details.input_length == len(oracle.tokenizer(prompt)["input_ids"])
    texts = list(client.text_generation(prompt, max_new_tokens=8, stream=True))
    assert "".join(texts) == events[-1].generated_text


def test_a_stop_sequence_ends_the_text_and_stays_in_it_as_tgi_does(tgi_server, oracles):
    """TGI returns the stop sequence that ended the generation as part of generated_text (and the
    OpenAI API returns it only with vLLM's include_stop_str_in_output)."""
    oracle = oracles("qwen2")
    prompt = PROMPTS[1]
    text = oracle.tokenizer.decode(greedy_ids(oracle, prompt, 12), skip_special_tokens=True)
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 2) if text[i:i + 3].strip())
    cut = text.index(stop) + len(stop)
    out = hf(tgi_server).text_generation(prompt, max_new_tokens=12, stop=[stop], details=True)
    assert (out.generated_text, out.details.finish_reason) == (text[:cut], "stop_sequence")
    openai = dict(model="tiny-qwen2", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    plain = httpx.post(tgi_server.url + "/v1/completions", json=openai, headers=auth(), timeout=60).json()
    kept = httpx.post(tgi_server.url + "/v1/completions", json=dict(openai, include_stop_str_in_output=True),
                      headers=auth(), timeout=60).json()
    assert plain["choices"][0]["text"] == text[:cut - len(stop)]
    assert (kept["choices"][0]["text"], kept["choices"][0]["finish_reason"]) == (text[:cut], "stop")


def test_generate_routes_and_info_have_tgi_shapes(tgi_server, oracles):
    oracle = oracles("qwen2")
    prompt = PROMPTS[1]
    want = greedy_ids(oracle, prompt, 6)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 6, "details": True, "top_n_tokens": 2}}
    r = httpx.post(tgi_server.url + "/generate", json=body, headers=auth(), timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()  # /generate answers one object (POST / a list of one)
    assert [t["id"] for t in out["details"]["tokens"]] == want
    assert [top[0]["id"] for top in out["details"]["top_tokens"]] == want  # greedy: the most likely one
    assert out["details"]["prefill"] == []
    lines = []
    with httpx.stream("POST", tgi_server.url + "/generate_stream", json=body, headers=auth(), timeout=120) as r:
        assert r.status_code == 200
        lines = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in lines] == want
    assert lines[-1]["generated_text"] == out["generated_text"]
    info = InferenceClient(tgi_server.url, provider="hf-inference", api_key=KEY).get_endpoint_info()  # GET /info
    assert info["model_id"] == "tiny-qwen2" and info["model_dtype"] == "torch.float32"
    assert info["max_total_tokens"] == info["max_input_tokens"] + 1
    paths = httpx.get(tgi_server.url + "/openapi.json").json()["paths"]
    assert "TgiRequest" in json.dumps(paths["/generate"]) and "/" in paths and "/info" in paths


def test_unimplemented_fields_are_400_and_unknown_ones_are_named(tgi_server):
    with pytest.raises(ValidationError, match="watermark"):
        hf(tgi_server).text_generation(PROMPTS[0], max_new_tokens=4, watermark=True)
    for parameters, field in [({"typical_p": 0.5}, "typical_p"), ({"best_of": 2}, "best_of"),
                              ({"grammar": {"type": "lark", "value": "x"}}, "grammar"),
                              # once "type 'regex' is not supported: use ... regex"
                              ({"grammar": {"type": "regex", "value": {"a": 1}}}, "grammar.value")]:
        r = httpx.post(tgi_server.url + "/generate", json={"inputs": "hi", "parameters": parameters}, headers=auth())
        assert r.status_code == 400, parameters
        assert field in r.json()["error"] and r.json()["error_type"] == "validation"
    r = httpx.post(tgi_server.url + "/generate", headers=auth(),  # a field no API defines: served without it
                   json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "nonsense": 1}})
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "parameters.nonsense"
    r = httpx.post(tgi_server.url + "/generate_stream", headers=auth(),
                   json={"inputs": "hi", "parameters": {"decoder_input_details": True, "details": True}})
    assert r.status_code == 400 and "decoder_input_details" in r.json()["error"]  # not streamed (TGI's rule)


def test_decoder_input_details_are_the_prompt_logprobs(tgi_server, oracles):
    """details.prefill: each prompt token with its log-probability under the tokens before it."""
    import torch

    oracle = oracles("qwen2")
    prompt = PROMPTS[1]
    ids = oracle.tokenizer(prompt)["input_ids"]
    out = hf(tgi_server).text_generation(prompt, max_new_tokens=2, details=True, decoder_input_details=True)
    prefill = out.details.prefill
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    with torch.no_grad():
        logits = oracle.model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert [t.logprob for t in prefill[1:]] == pytest.approx(want, abs=1e-3)


# ---- server.metrics_port --------------------------------------------------------------------------


def samples(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "llaunch:" + name}


def test_metrics_port_serves_without_the_key_the_api_port_needs_it(tgi_server):
    before = samples(httpx.get(tgi_server.metrics_url).text, "generation_tokens_total")
    hf(tgi_server).text_generation(PROMPTS[0], max_new_tokens=5)
    r = httpx.get(tgi_server.metrics_url)  # no key
    assert r.status_code == 200
    after = samples(r.text, "generation_tokens_total")
    key = (("model_name", "tiny-qwen2"),)
    assert after[key] - before.get(key, 0.0) >= 5  # the detokenizer records a request before its text leaves
    assert samples(r.text, "request_success_total")
    assert httpx.get(tgi_server.url + "/metrics").status_code == 401  # the API port keeps its key
    assert httpx.get(tgi_server.url + "/metrics", headers=auth()).status_code == 200
    assert f"metrics at {tgi_server.metrics_url}" in tgi_server.output()  # the launcher's serving line


def llaunch(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llaunch.launcher.main", *CPU_BASE, *overrides,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_dry_run_shows_the_metric_server_and_ports_are_checked(tmp_path, tiny_dirs):
    model = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}"]
    port = free_port()
    r = llaunch(tmp_path, *model, f"server.metrics_port={port}", "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert f"metrics http://127.0.0.1:{port}/metrics" in r.stdout
    r = llaunch(tmp_path, *model, f"server.port={port}", f"server.metrics_port={port}", "dry_run=true")
    assert r.returncode == 2 and "server.metrics_port" in r.stderr and "server.port" in r.stderr
    with socket.socket() as held:  # a port another process holds: refused before anything starts
        held.bind(("127.0.0.1", 0))
        held.listen()
        r = llaunch(tmp_path, *model, f"server.metrics_port={held.getsockname()[1]}")
    assert r.returncode == 2 and "metrics_port_free" in r.stderr, r.stderr


def test_huggingface_hub_chat_completion_works_whatever_the_model_name(tgi_server, oracles):
    """InferenceClient(base_url).chat_completion sends model "dummy"; TGI serves its one model anyway."""
    oracle = oracles("qwen2")
    messages = [{"role": "user", "content": "Hello"}]
    out = hf(tgi_server).chat_completion(messages, max_tokens=5, temperature=0)
    text = oracle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = oracle.tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = oracle.model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    want = oracle.greedy(prompt, 5)
    want = next((want[:i + 1] for i, t in enumerate(want) if t in eos), want)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(want)
    assert out.choices[0].message.content == oracle.tokenizer.decode(want, skip_special_tokens=True)
