"""cache.dp_fetch's accounting through the scheduler (runtime/router/dp_fetch.py, runtime/cache/host_tier.py):
replica 1 fetches a prefix from replica 0's host pool and then the request ends every way it can while the
fetch's plan is out (aborted, finished, or the worker gone: Scheduler.fail_all); afterwards no pin of
replica 1 is left in replica 0's index and every slot of both replicas is accounted for. A waiting request's
prefix keys are hashed once however often admission retries it, and a demotion the host pool cannot take
drops no host entry for nothing. Real index files, no model."""
import numpy as np
import pytest

from llaunch.runtime.cache.host_index import index_bytes
from llaunch.runtime.cache.host_pool import create_pool
from llaunch.runtime.cache.host_tier import TieredPrefixTree
from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, StepResult
from llaunch.runtime.router import dp_fetch
from llaunch.runtime.router.dp_fetch import DpFetch
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.router.tiered_cache import TieredPromptCache
from unit import test_host_tier as host_tier

HOST = 32
FIRST = [100 + i for i in range(32)]  # two 16-token blocks, cached by replica 0 only


def index_files(tmp_path):
    paths = [str(tmp_path / f"index{d}") for d in range(2)]
    for p in paths:
        create_pool(p, index_bytes(HOST, 2))
    return paths


def owner_with_first(paths):
    """Replica 0 with FIRST demoted to its host pool and published."""
    owner = TieredPromptCache(KvAllocator(64), HOST, DpFetch(0, paths, HOST))
    owner.tree.insert(FIRST, owner.kv.alloc(len(FIRST)))
    assert owner.tree.evict(32) == 32 and owner.tree.host_tokens == 32
    owner.take_moves()
    owner.returned()
    return owner


def fetcher(paths, kv_slots=64):
    return Scheduler(SchedulerLimits(kv_slots=kv_slots, max_running=4, batch_max_tokens=64, chunked_prefill=True,
                                     chunked_prefill_size=64, max_wait_tokens=1, token_ratio=0.0, max_model_len=128,
                                     eos_ids=(2,), prompt_cache=True, host_kv_tokens=HOST, dp_fetch=(1, tuple(paths))))


def request(rid, prompt_ids, max_new):
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=list(prompt_ids),
                     sampling=SamplingParams(max_new_tokens=max_new), arrival_time=0.0)
    return Request(msg, msg.sampling)


def answer(s, plan):
    rows = list(plan.decode_rows) + [c.row for c in plan.prefill if c.sample]
    return s.on_result(StepResult(step=plan.step, rows=rows, token_ids=[7] * len(rows)))


def assert_accounted(s):
    host_tier.assert_accounted(s, held=s.cache.fetch.held)
    assert s.cache.host.num_slots == HOST


@pytest.mark.parametrize("end", ["abort", "finish", "fail_all"])
def test_no_pin_outlives_a_fetch_whatever_ends_its_request(tmp_path, end):
    paths = index_files(tmp_path)
    owner = owner_with_first(paths)
    s = fetcher(paths)
    assert s.add(request("r", FIRST + [5, 6], max_new=1 if end == "finish" else 8)) is None
    plan = s.schedule()
    fetched = [m for m in plan.kv_moves if m.replica == 0]
    assert [len(m.host_slots) for m in fetched] == [32]
    assert owner.fetch.own.pins.sum() == 32  # replica 1's row, while its plan is out
    if end == "abort":
        s.abort("r")
        answer(s, plan)
    elif end == "finish":
        assert answer(s, plan)[0].finish_reason == "length"
    else:
        assert [d.finish_reason for d in s.fail_all("stalled", "worker gone")] == ["stalled"]
    assert owner.fetch.own.pins.sum() == 0
    if end != "fail_all":  # a failed replica plans nothing more; the others keep their accounting
        assert_accounted(s)
    # the owner's host slots all come back: drop FIRST (as a flush does), every slot is free again
    owner.tree.flush()
    owner.fetch.host.free_unpinned()
    assert owner.fetch.held == [] and sorted(owner.host._free) == list(range(HOST))


def test_a_waiting_request_hashes_its_prefix_once(tmp_path, monkeypatch):
    paths = index_files(tmp_path)
    owner_with_first(paths)
    s = fetcher(paths, kv_slots=48)
    calls = []
    real = dp_fetch.token_keys
    monkeypatch.setattr(dp_fetch, "token_keys", lambda *a, **k: calls.append(1) or real(*a, **k))
    running = request("a", [900 + i for i in range(8)], max_new=30)  # holds most of the KV while it decodes
    s.add(running)
    plans = [s.schedule()]
    s.add(request("b", FIRST + [5], max_new=8))  # does not fit beside "a": waits, retried every step
    for _ in range(5):
        answer(s, plans[-1])
        plans.append(s.schedule())
        assert s.waiting and s.waiting[0].id == "b"
    assert len(calls) == 1  # not once per admission attempt
    assert_accounted(s)


def test_a_demotion_the_host_pool_cannot_take_drops_no_host_entry(tmp_path):
    """Replica 0's host pool is full of FIRST, which replica 1 is fetching (pinned): evicting another GPU
    prefix cannot find room there, so that prefix is dropped and FIRST stays cached (dropping it would
    free nothing while the pin lasts)."""
    paths = index_files(tmp_path)
    owner = owner_with_first(paths)
    peer = TieredPromptCache(KvAllocator(64), HOST, DpFetch(1, paths, HOST))
    assert len(peer.fetch.lend(request("r", FIRST + [5], 8), 0, 32, 64, peer.kv.alloc)) == 32
    second = [300 + i for i in range(32)]
    owner.tree.insert(second, owner.kv.alloc(32))
    assert owner.tree.evict(32) == 32
    assert owner.fetch.held == [] and owner.tree.host_tokens == 32
    owner.tree.match(FIRST)
    assert sum(len(n.slots) for n in owner.tree.host_path) == 32  # still fetchable, by both replicas
    owner.tree.match(second)
    assert owner.tree.host_path == []
    assert np.all(owner.fetch.own.stamps != 0)  # FIRST's keys are still published


def test_a_demotion_that_cannot_fit_beside_a_promotion_drops_no_host_entry():
    """No dp_fetch: the host pool holds A (droppable) and B (being promoted); a 32-token GPU node cannot
    fit in A's 16 slots, so it is dropped and A stays cached (the check comes before any drop)."""
    tree = TieredPrefixTree(KvAllocator(64), KvAllocator(32))
    a, b, c = ([base + i for i in range(n)] for base, n in ((100, 16), (200, 16), (300, 32)))
    for tokens in (a, b):
        tree.insert(tokens, tree.allocator.alloc(16))
        assert tree.evict(16) == 16
    assert tree.host.num_free == 0
    tree.insert(c, tree.allocator.alloc(32))
    tree.match(b)
    tree.pin(tree.host_path)
    assert tree.evict(32) == 32
    tree.unpin()
    assert tree.dropped == 32 and tree.host_tokens == 32  # only c went
    for tokens in (a, b):
        assert tree.match(tokens)[0] == [] and sum(len(n.slots) for n in tree.host_path) == 16
    assert tree.match(c)[0] == [] and tree.host_path == []
