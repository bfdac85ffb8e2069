"""The prompt cache end to end on CPU (tiny random Qwen2, float32): outputs with the cache are
token-identical to outputs without it, also when a small KV budget forces eviction mid-run; once
every request has finished each slot is free or held by the tree, and a flush frees them all.

In one process first (scheduler + the worker's model runner, pipelined steps, exact slot checks),
then through two real servers (cache=default and cache=no_prompt_cache) over HTTP, with the
prefix-cache metrics and POST /flush_cache.
"""
from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from fixtures.tiny_models import model_config_from_folder
from integration.server import LlaunchServer
from llaunch.runtime.detokenizer.detokenizer import HEARTBEAT_S
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.runner import ModelRunner

MAX_ROWS = 6


# ---- in one process: the scheduler drives the real model runner ----------------------------------


class Engine:
    """Router logic and worker runner without processes: plans run in order as soon as they are
    made (as the worker does), results come back `depth` steps later (as the router sees them)."""

    def __init__(self, model, prompt_cache: bool, kv_slots: int, depth: int = 2, cuda_graphs: bool = False):
        self.sched = Scheduler(SchedulerLimits(
            kv_slots=kv_slots, max_running=MAX_ROWS, batch_max_tokens=48, chunked_prefill=True,
            chunked_prefill_size=16, max_wait_tokens=2, token_ratio=0.0, max_model_len=256, eos_ids=(2,),
            pipeline_depth=depth, prompt_cache=prompt_cache))
        kv = model.make_kv_cache(kv_slots + 1, MAX_ROWS + 1, 256)
        self.runner = ModelRunner(model, kv, MAX_ROWS, kv.k[0].device, cuda_graphs=cuda_graphs)
        self.evicted = 0
        if prompt_cache:
            tree = self.sched.cache.tree
            evict = tree.evict

            def counted(n: int) -> int:
                freed = evict(n)
                self.evicted += freed
                return freed

            tree.evict = counted

    def run(self, jobs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
        for rid, (prompt, sp) in jobs.items():
            msg = AddRequest(request_id=rid, frontend=0, prompt_ids=prompt, sampling=sp, arrival_time=0.0)
            assert self.sched.add(Request(msg, sp)) is None
        out: dict[str, list[int]] = {rid: [] for rid in jobs}
        results = []
        while self.sched.has_work() or results:
            while len(results) < self.sched.limits.pipeline_depth:
                plan = self.sched.schedule()
                if plan is None:
                    break
                results.append(self.runner.execute(plan))
            for delta in self.sched.on_result(results.pop(0)):
                out[delta.request_id].extend(delta.token_ids)
        return out


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49152) for _ in range(n)]


def conversation_jobs(rng, systems, first: dict[str, list[int]] | None, prompts: dict[str, list[int]] | None):
    """Wave 1: a system prompt of a group plus a user turn each; wave 2 (given wave 1's prompts and
    outputs): every other conversation sends its history plus a new turn."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    if first is None:
        return {f"c{i}": (systems[i % len(systems)] + random_ids(rng, 6), seeded if i % 5 == 4 else greedy)
                for i in range(12)}
    return {f"{rid}/2": (prompts[rid] + first[rid] + random_ids(rng, 5), greedy) for rid in list(first)[::2]}


def test_same_tokens_with_and_without_the_cache_in_process(tiny_dirs, oracles):
    model = build_model(model_config_from_folder(tiny_dirs["qwen2"]), device=torch.device("cpu"), dtype=torch.float32)
    rng = random.Random(5)
    systems = [random_ids(rng, n) for n in (40, 50, 30)]
    wave1 = conversation_jobs(rng, systems, None, None)
    # 12 + 6 sequences of ~55-75 distinct tokens each against 160 slots: the cache must evict
    engines = {"cache": Engine(model, True, kv_slots=160), "plain": Engine(model, False, kv_slots=160)}
    outs1 = {name: e.run(wave1) for name, e in engines.items()}
    assert outs1["cache"] == outs1["plain"]
    wave2 = conversation_jobs(rng, systems, outs1["plain"], {rid: p for rid, (p, _) in wave1.items()})
    outs2 = {name: e.run(wave2) for name, e in engines.items()}
    assert outs2["cache"] == outs2["plain"]

    hf = oracles("qwen2")  # the cache-free path is transformers' greedy; check two cached requests too
    for rid in ("c3", "c0/2"):
        prompt = (wave1 | wave2)[rid][0]
        assert (outs1["cache"] | outs2["cache"])[rid] == hf.greedy(prompt, 6)

    cache = engines["cache"].sched
    assert engines["cache"].evicted > 0  # during the run: nothing else evicts
    assert cache.cache.hits > 0 and cache.cache.queries == sum(len(p) for p, _ in (wave1 | wave2).values())
    held = cache.cache.tree.cached_slots()
    assert sorted(held + cache.kv._free) == list(range(160))  # free or the tree's, once
    assert cache.kv.num_used == cache.cache.tokens == len(held) and cache.cache.locked == 0
    assert cache.cache.flush() == len(held) and cache.kv.num_used == 0
    assert engines["plain"].sched.kv.num_used == 0


# ---- through two servers over HTTP --------------------------------------------------------------

MODEL = "tiny-qwen2"
KV_SLOTS = 300


def metrics(server) -> dict[str, float]:
    """Every llaunch sample summed over its labels."""
    out: dict[str, float] = {}
    text = httpx.get(server.url + "/metrics").text
    for name, value in re.findall(r"^llaunch:(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_for(server, check, what: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if check(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {m}")
        time.sleep(0.1)


def idle(m: dict[str, float]) -> bool:
    return m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0


def settled(server) -> dict[str, float]:
    """The metrics once the earlier requests' last router reports are in: unchanged over a snapshot
    heartbeat (the detokenizer's snapshot on a request's end may precede its router's report)."""
    m = metrics(server)
    while True:
        time.sleep(HEARTBEAT_S + 0.1)
        again = metrics(server)
        if again == m and idle(m):
            return m
        m = again


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_dirs):
    base = ["device=cpu", "model.dtype=float32", "model=qwen2", f"model.path={tiny_dirs['qwen2']}",
            f"model.name={MODEL}", "model.max_model_len=256", f"cache.max_total_tokens={KV_SLOTS}",
            "router.max_running_requests=8", "router.chunked_prefill_size=32", "router.batch_max_tokens=64"]
    started = {name: LlaunchServer(base + [f"cache={profile}"], run_dir=tmp_path_factory.mktemp(f"run-{name}"))
               for name, profile in (("cache", "default"), ("plain", "no_prompt_cache"))}
    try:
        yield {name: s.wait_healthy() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


async def complete_all(server, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       cached: list[int] | None = None) -> list[list[int]]:
    """Each prompt's greedy tokens; `cached` gets each one's usage.prompt_tokens_details.cached_tokens."""
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    cap = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with cap:
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})
        if cached is not None:
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        return out.choices[0].model_extra["token_ids"]

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def test_servers_with_and_without_the_cache_agree_and_the_cache_flushes(servers):
    cache, plain = servers["cache"], servers["plain"]
    rng = random.Random(7)
    systems = [random_ids(rng, 60) for _ in range(4)]

    # a two-turn conversation, one turn at a time: the second reuses the first's prompt and all its
    # outputs but the last (whose KV was never computed)
    first = systems[0] + random_ids(rng, 10)
    cached: list[int] = []
    out_first = asyncio.run(complete_all(cache, [first], 8, 1, cached))[0]
    second = first + out_first + random_ids(rng, 10)
    out_second = asyncio.run(complete_all(cache, [second], 8, 1, cached))[0]
    queries = len(first) + len(second)
    m = wait_for(cache, lambda m: m["prefix_cache_queries_total"] == queries, "queries of the two turns")
    assert m["prefix_cache_hits_total"] == len(first) + 8 - 1
    assert cached == [0, len(first) + 8 - 1]  # the usage a client sees says the same
    assert asyncio.run(complete_all(plain, [first, second], 8, 1, cached)) == [out_first, out_second]
    assert cached[2:] == [0, 0]

    # shared system prompts under concurrency: 24 sequences of 80-90 distinct tokens against 300 slots,
    # so entries are evicted while requests run
    prompts = [systems[i % 4] + random_ids(rng, 10 + i % 3) for i in range(24)]
    outs = {name: asyncio.run(complete_all(s, prompts, 8, 6)) for name, s in servers.items()}
    assert outs["cache"] == outs["plain"]
    assert all(len(o) == 8 for o in outs["cache"])

    # idle: no slot in use by a request (kv usage 0 counts the tree's evictable entries as free, so
    # every allocated slot is the tree's), the tree holds something; a flush frees it all
    m = wait_for(cache, lambda m: idle(m) and m["prefix_cache_queries_total"] == queries + sum(map(len, prompts)),
                 "cache server idle")
    assert 0 < m["prefix_cache_usage_perc"] <= 1 and m["prefix_cache_hits_total"] > len(first) + 7
    assert httpx.post(cache.url + "/flush_cache").status_code == 200
    wait_for(cache, lambda m: idle(m) and m["prefix_cache_usage_perc"] == 0, "flushed")
    m = wait_for(plain, idle, "plain server idle")
    assert m["prefix_cache_usage_perc"] == m["prefix_cache_queries_total"] == m["prefix_cache_hits_total"] == 0

    # the flushed server computes everything again, to the same tokens
    assert asyncio.run(complete_all(cache, prompts[:3], 8, 3)) == outs["plain"][:3]
