"""LightLLM's smaller start-up switches through a real server: the graph over loopback TCP instead of
ipc sockets (parallel.zmq_mode=tcp), dp prefill balancing, and an eos override (LightLLM's eos_id)."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
from openai import AsyncOpenAI, OpenAI

from integration.conftest import start_server
from integration.test_parallel import admitted_requests

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,",
           "A B C D E", "def main():", "Hello, my name is", "The weather today", "In 1492,"]
EOS_PROMPT = "Hello, my name is"
MAX_NEW = 8


@pytest.fixture(scope="module")
def eos_choice(oracles):
    """The fourth greedy token of EOS_PROMPT, when it does not occur before: the overriding eos."""
    oracle = oracles("qwen2")
    ids = oracle.greedy(oracle.tokenizer(EOS_PROMPT)["input_ids"], MAX_NEW)
    assert ids[3] not in ids[:3], ids
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs, eos_choice):
    overrides = ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", "model.name=tiny-qwen2", "parallel=dp2",
                 "parallel.zmq_mode=tcp", "router.dp_prefill_balance=true",
                 f"model.eos_token_ids=[{eos_choice[3]}]"]
    with start_server(tmp_path_factory, "switches", overrides) as s:
        yield s


def test_the_graph_talks_over_tcp(server):
    config = msgspec.yaml.decode((server.run_dir / "config.yaml").read_bytes())
    addresses = [a for p in config["graph"]["processes"] for a in (*p["binds"].values(), *p["connects"].values())]
    assert addresses and all(a.startswith("tcp://127.0.0.1:") for a in addresses), addresses
    assert config["graph"]["ipc_dir"] == ""


def test_dp2_over_tcp_serves_greedy_output_on_both_replicas(server, oracles):
    oracle = oracles("qwen2")
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def one(prompt):
        out = await client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=MAX_NEW,
                                              temperature=0, extra_body={"ignore_eos": True,
                                                                         "return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    for prompt, ids in zip(PROMPTS, asyncio.run(all_at_once())):
        assert ids == oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW), prompt
    per_replica = [admitted_requests(server.run_dir, d) for d in (0, 1)]
    assert per_replica[0] and per_replica[1], per_replica


def test_eos_override_stops_generation(server, eos_choice):
    api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = api.completions.create(model="tiny-qwen2", prompt=EOS_PROMPT, max_tokens=MAX_NEW, temperature=0,
                                 extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"][:3] == eos_choice[:3]
    assert out.usage.completion_tokens <= 4  # three tokens and the overriding eos at most
