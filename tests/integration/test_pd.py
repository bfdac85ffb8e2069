"""Prefill/decode disaggregation on CPU: a pd_master, one pd_prefill and two pd_decode instances
(four llaunch commands on loopback; KV moves over the ZMQ transport) serve the openai client.

- greedy output through the master equals transformers' (normal mode equals it too: test_correctness);
- 16 concurrent streams complete with the right text;
- a decode instance killed mid-stream: its request ends with an error, the master marks it
  unhealthy, and the other decode instance serves the next requests.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from openai import APIError, AsyncOpenAI, OpenAI

from integration.conftest import start_server
from integration.server import free_port
from integration.test_parallel import GREEDY, model_overrides, start_all, stop_all

MASTER_BASE = ["device=cpu"]  # a pd_master or config server runs no model: the model's keys would be refused
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def pd_deployment(tmp_path_factory, tiny_dirs):
    register = free_port()
    pd = [f"mode.pd_master_port={register}"]
    model = model_overrides("qwen2", tiny_dirs)
    servers = start_all([
        start_server(tmp_path_factory, "pd-master", ["mode=pd_master"] + pd, base=MASTER_BASE),
        start_server(tmp_path_factory, "pd-prefill", model + ["mode=pd_prefill"] + pd),
        start_server(tmp_path_factory, "pd-decode-a", model + ["mode=pd_decode"] + pd),
        start_server(tmp_path_factory, "pd-decode-b", model + ["mode=pd_decode"] + pd),
    ])
    master = servers[0]
    deadline = time.monotonic() + 30
    while len(healthy(master, "decode")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(healthy(master, "decode")) == 2, instances(master)
    yield dict(zip(("master", "prefill", "decode_a", "decode_b"), servers))
    stop_all(servers)


def instances(master) -> list[dict]:
    return httpx.get(master.url + "/pd/instances", timeout=5).json()["instances"]


def healthy(master, role: str) -> list[dict]:
    return [i for i in instances(master) if i["role"] == role and i["healthy"]]


def test_greedy_output_equals_transformers(pd_deployment, oracles):
    master = pd_deployment["master"]
    oracle = oracles("qwen2")
    api = OpenAI(base_url=master.url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 16)
        out = api.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body=GREEDY)
        assert out.choices[0].model_extra["token_ids"] == want, prompt
        stream = api.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body=GREEDY, stream=True)
        ids = [t for chunk in stream for c in chunk.choices for t in c.model_extra.get("token_ids") or []]
        assert ids == want, prompt
    transfers = [i["kv_transfers"] for i in instances(master) if i["role"] == "prefill"]
    assert transfers and transfers[0] >= 2 * len(PROMPTS)  # the prompts' KV really moved


def test_16_concurrent_streams_complete(pd_deployment, oracles):
    master = pd_deployment["master"]
    oracle = oracles("qwen2")
    prompts = [f"Request {i}: " + "count with me " * (1 + i % 5) for i in range(16)]
    client = AsyncOpenAI(base_url=master.url + "/v1", api_key="none", max_retries=0)

    async def one(prompt):
        stream = await client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body=GREEDY, stream=True)
        return [t async for chunk in stream for c in chunk.choices for t in c.model_extra.get("token_ids") or []]

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    for prompt, ids in zip(prompts, asyncio.run(all_at_once())):
        assert ids == oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 12), prompt
    served = {i["id"]: i["inflight"] for i in instances(master)}
    assert all(n == 0 for n in served.values()), served


def test_killed_decode_instance_fails_its_requests_and_the_other_takes_over(pd_deployment):
    master = pd_deployment["master"]
    api = OpenAI(base_url=master.url + "/v1", api_key="none", max_retries=0)
    stream = api.completions.create(model="tiny-qwen2", prompt="Tell me a long story", max_tokens=500,
                                    temperature=0, extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))  # generating on one decode instance
    [busy] = [i for i in instances(master) if i["role"] == "decode" and i["inflight"] > 0]
    victim = next(s for name, s in pd_deployment.items() if name.startswith("decode") and s.url == busy["url"])
    os.kill(victim.proc.pid, signal.SIGKILL)  # the launcher; its children die with it
    with pytest.raises(APIError):
        for _ in stream:
            pass
    deadline = time.monotonic() + 10
    while busy["id"] in {i["id"] for i in healthy(master, "decode")} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert busy["id"] not in {i["id"] for i in healthy(master, "decode")}
    for _ in range(3):
        out = api.completions.create(model="tiny-qwen2", prompt="Still serving?", max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("transport", ["zmq", "nccl"])
def test_tensor_parallel_instances_move_each_ranks_kv_heads(transport, tmp_path_factory, tiny_dirs, oracles):
    """tp2 prefill → tp2 decode: rank r ships its KV heads to rank r (Qwen2's 2 KV heads split), over
    ZMQ, and over a torch.distributed pair group per rank pair (NCCL on GPUs; gloo here)."""
    register = free_port()
    common = model_overrides("qwen2", tiny_dirs) + [f"mode.pd_master_port={register}", "parallel=tp2"]
    servers = start_all([
        start_server(tmp_path_factory, f"pd2-{transport}-master", ["mode=pd_master", f"mode.pd_master_port={register}"],
                     base=MASTER_BASE),
        start_server(tmp_path_factory, f"pd2-{transport}-prefill", common + ["mode=pd_prefill"]),
        # the decode instance chooses the transport and advertises it (on a prefill instance the key is refused)
        start_server(tmp_path_factory, f"pd2-{transport}-decode", common + ["mode=pd_decode",
                                                                            f"mode.kv_transport={transport}"]),
    ])
    try:
        oracle = oracles("qwen2")
        api = OpenAI(base_url=servers[0].url + "/v1", api_key="none", max_retries=0)
        for prompt in PROMPTS:
            out = api.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body=GREEDY)
            assert out.choices[0].model_extra["token_ids"] == oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 16)
        [decode] = healthy(servers[0], "decode")
        assert [a.split("://")[0] for a in decode["kv_address"].split(",")] == [{"zmq": "tcp"}.get(transport, transport)] * 2
    finally:
        stop_all(servers)


def test_instances_find_their_master_through_a_config_server(tmp_path_factory, tiny_dirs, oracles):
    """mode=config_server: the master registers there, the instances ask it for masters and register
    with every one it lists; nobody is told the master's address."""
    register = free_port()
    # the config server serves on the port the test harness gives it (and polls /health on)
    servers = start_all([start_server(tmp_path_factory, "cs-registry", ["mode=config_server"], base=MASTER_BASE,
                                      port_key="mode.config_server_port")])
    config_port = servers[0].port
    found_by_registry = ["mode.config_server_host=127.0.0.1", f"mode.config_server_port={config_port}"]
    model = model_overrides("qwen2", tiny_dirs)
    servers += start_all([
        start_server(tmp_path_factory, "cs-master", ["mode=pd_master", f"mode.pd_master_port={register}"]
                     + found_by_registry, base=MASTER_BASE),
        # no mode.pd_master_port: with a config server named it would be refused as unread
        start_server(tmp_path_factory, "cs-prefill", model + ["mode=pd_prefill"] + found_by_registry),
        start_server(tmp_path_factory, "cs-decode", model + ["mode=pd_decode"] + found_by_registry),
    ])
    try:
        entries = httpx.get(f"http://127.0.0.1:{config_port}/registry", timeout=5).json()["entries"]
        assert sorted(e["role"] for e in entries) == ["decode", "master", "prefill"]
        oracle = oracles("qwen2")
        api = OpenAI(base_url=servers[1].url + "/v1", api_key="none", max_retries=0)
        out = api.completions.create(model="tiny-qwen2", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     extra_body=GREEDY)
        assert out.choices[0].model_extra["token_ids"] == oracle.greedy(oracle.tokenizer(PROMPTS[0])["input_ids"], 8)
    finally:
        stop_all(servers)
