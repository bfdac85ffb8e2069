"""dp cache fetch (cache.dp_fetch) on CPU, tiny random Qwen2 in float32. In process: two replicas'
router logic and runners over real pool and index files; a prompt whose prefix replica 0 demoted to its
host tier is fetched by replica 1 from replica 0's pool: the same tokens and the same KV as a cache that
never evicts, every slot of both replicas accounted for, no pin left. Then one dp=2 server: a prompt
served by replica 0 and demoted there, sent again while replica 0 is busy (so it lands on replica 1),
answers what it answered cold, and llaunch:dp_fetched_tokens_total counts the fetch."""
from __future__ import annotations

import os
import random
import threading

import httpx
import numpy as np
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder
from integration.conftest import start_server
from integration.test_host_tier import GREEDY, TieredEngine, assert_same_kv
from integration.test_prompt_cache import Engine, random_ids, wait_for
from llaunch.runtime.cache.host_index import index_bytes
from llaunch.runtime.cache.host_pool import create_pool
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.host_kv import HostKvPool

KV, HOST = 110, 220


class Replica(TieredEngine):
    """A TieredEngine of replica `rank` whose cache fetches through the index files, and whose pool
    reads the other replicas' pool files."""

    def __init__(self, model, rank: int, tmp_path):
        pools = [str(tmp_path / f"pool{d}") for d in range(2)]
        indexes = [str(tmp_path / f"index{d}") for d in range(2)]
        for path in indexes:
            if not os.path.exists(path):
                create_pool(path, index_bytes(HOST, 2))
        super().__init__(model, kv_slots=KV, host_slots=HOST, pool_file=pools[rank])
        self.sched = Scheduler(SchedulerLimits(**{**self.sched.limits.__dict__, "dp_fetch": (rank, tuple(indexes))}))
        other = 1 - rank
        if not os.path.exists(pools[other]):
            create_pool(pools[other], HOST * model.kv_bytes_per_token)
        self.pool = HostKvPool(self.runner.kv, pools[rank], HOST, torch.device("cpu"), timeout_s=5,
                               peers={other: pools[other]})


def test_a_prefix_demoted_on_one_replica_is_fetched_by_the_other_in_process(tiny_dirs, tmp_path):
    model = build_model(model_config_from_folder(tiny_dirs["qwen2"]), device=torch.device("cpu"), dtype=torch.float32)
    zero, one = Replica(model, 0, tmp_path), Replica(model, 1, tmp_path)
    big = Engine(model, True, kv_slots=1200)  # never evicts: the reference KV
    cold = Engine(model, False, kv_slots=1200)  # no prompt cache at all: the reference tokens
    rng = random.Random(5)
    history = random_ids(rng, 90)
    first = {"h": (history, GREEDY)}
    fill = {f"f{i}": (random_ids(rng, 50), GREEDY) for i in range(3)}  # push the history out of 110 slots
    assert zero.run(first) == big.run(first)
    zero.run(fill), big.run(fill)
    assert zero.sched.cache.tree.demoted >= 64
    again = {"h2": (history + random_ids(rng, 6), GREEDY)}
    got = one.run(again)
    assert got == cold.run(again) == big.run(again)
    fetch = one.sched.cache.fetch
    assert fetch.fetched >= 64 and fetch.fetched % 16 == 0  # whole blocks of the history
    assert_same_kv(one, big)  # what replica 1 holds now, fetched slots included, is the history's KV
    for r in (zero, one):  # every slot accounted for, no pin left
        s, tree = r.sched, r.sched.cache.tree
        gpu = [x for n in tree.nodes() if not n.on_host for x in n.slots]
        host = [x for n in tree.nodes() if n.on_host for x in n.slots]
        assert sorted(gpu + s.kv._free) == list(range(KV))
        assert sorted(host + s.cache.host._free + s.cache.fetch.held) == list(range(HOST))
        assert not s.cache.fetch.own.pins.any() and s.cache.locked == 0


def test_a_pinned_slot_is_not_reused_until_the_fetch_returns(tmp_path):
    from llaunch.runtime.router.dp_fetch import DpFetch

    paths = [str(tmp_path / f"index{d}") for d in range(2)]
    for p in paths:
        create_pool(p, index_bytes(8, 2))
    owner, fetcher = DpFetch(0, paths, 8), DpFetch(1, paths, 8)
    slots = owner.host.alloc(3)
    keys = np.array([11, 12, 13], dtype=np.uint64) | np.uint64(1 << 63)
    owner.own.publish(np.asarray(slots), keys)
    found = fetcher.indexes[0].lookup(keys)
    assert found.tolist() == slots
    assert fetcher.indexes[0].pin(1, found, keys) == 3
    owner.host.free(slots)  # the owner drops them while the fetch is out: they wait
    assert owner.held == slots and owner.host.num_free == 5
    assert fetcher.indexes[0].pin(1, found, keys) == 0  # unpublished: no new fetch takes them
    fetcher.indexes[0].unpin(1, slots)
    owner.returned()  # nothing in flight; frees what is no longer pinned
    assert owner.held == [] and owner.host.num_free == 8


# ---- one dp=2 server --------------------------------------------------------------------------

MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    with start_server(tmp_path_factory, "dp-fetch",
                      ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}", "parallel=dp2",
                       "cache.max_total_tokens=600", "cache.cpu_tokens=1200", "cache.dp_fetch=true",
                       "router.max_running_requests=4", "model.max_model_len=512"]) as srv:
        yield srv


def complete(server, prompt: list[int], max_tokens: int = 4) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_replica_fetches_what_the_other_demoted(server):
    rng = random.Random(21)
    history = random_ids(rng, 120)
    cold = complete(server, history)  # an idle server: replica 0 (the least loaded, first)
    for _ in range(3):  # push it out of replica 0's 600 GPU slots, to its host tier
        complete(server, random_ids(rng, 250))
    m = wait_for(server, lambda m: m.get("kv_demoted_tokens_total", 0) >= 120, "the history demoted")
    busy = httpx.Client(timeout=120)
    with busy.stream("POST", server.url + "/v1/completions",
                     json={"model": MODEL, "prompt": random_ids(rng, 8), "max_tokens": 500, "temperature": 0,
                           "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
        next(lines)  # replica 0 is decoding it (for a second or so): the next prompt goes to replica 1
        result = {}
        t = threading.Thread(target=lambda: result.update(text=complete(server, history)))
        t.start()
        t.join(120)
    assert result["text"] == cold
    m = wait_for(server, lambda m: m.get("dp_fetched_tokens_total", 0) > 0, "a dp fetch")
    assert m["dp_fetched_tokens_total"] >= 96
