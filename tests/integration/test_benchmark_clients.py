"""The benchmark clients people point at a serving engine, unchanged, against a tiny Qwen2 checkpoint (float32,
CPU): guidellm's default streaming chat benchmark (it sends vLLM's stream_options.continuous_usage_stats and
max_completion_tokens with ignore_eos) and LightLLM's /generate_stream payload as LightLLM's own benchmark scripts
send it (parameters.add_special_tokens among them). Every request must succeed with the token counts the server's
tokenizer gives, and LightLLM's greedy stream must be transformers' greedy tokens."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

MODEL = "tiny-qwen2"
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 6, 4


@pytest.fixture(scope="module")
def oracle(oracles):
    return oracles("qwen2")


def test_guidellm_streaming_benchmark(tiny_qwen2_server, tiny_dirs, oracle, tmp_path):
    guidellm = Path(sys.executable).with_name("guidellm")
    out = tmp_path / "benchmark.json"
    run = subprocess.run(
        [str(guidellm), "run", "--backend", f"kind=openai_http,target={tiny_qwen2_server.url},model={MODEL}",
         "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
         "--tokenizer", f"kind=huggingface_auto,model={tiny_dirs['qwen2']}", "--output", f"kind=json,path={out}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [benchmark] = json.loads(out.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": REQUESTS}
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"] is True  # what a strict server refused
        rendered = oracle.tokenizer.apply_chat_template(
            [{"role": "user", "content": body["messages"][0]["content"][0]["text"]}], add_generation_prompt=True,
            tokenize=True, return_dict=True)["input_ids"]
        assert (request["prompt_tokens"], request["output_tokens"]) == (len(rendered), OUTPUT_TOKENS)
        assert request["time_to_first_token_ms"] > 0 and request["output"]


def test_lightllm_generate_stream_payload(tiny_qwen2_server, oracle):
    """LightLLM's test/benchmark/service client: `inputs` and its `parameters` (do_sample, ignore_eos,
    max_new_tokens, add_special_tokens=false), one `data:{...}` line per token."""
    text = "The quick brown fox jumps over the lazy dog"
    body = {"inputs": text, "parameters": {"do_sample": False, "ignore_eos": True, "max_new_tokens": 8,
                                           "add_special_tokens": False, "best_of": 1}}
    with httpx.stream("POST", tiny_qwen2_server.url + "/generate_stream", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[len("data:"):]) for line in r.iter_lines() if line.startswith("data:")]
    ids = oracle.tokenizer.encode(text, add_special_tokens=False)
    assert [e["token"]["id"] for e in events] == oracle.greedy(ids, 8)
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "length"
