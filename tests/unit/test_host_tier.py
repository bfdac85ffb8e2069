"""The host KV tier under the prompt cache (runtime/cache/host_tier.py, runtime/router/tiered_cache.py),
driven through the scheduler with a simulated KV pool: every slot holds the token context its KV
encodes, the plans' moves copy contents between the GPU and host pools in order, and every prefix a
new request reuses must hold exactly its prompt's contexts. Every slot of both pools is accounted for."""
import random

import pytest

from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, StepResult
from llaunch.runtime.router.request import Request, Status
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits

TOKEN = 7  # every sampled token: a sequence's contexts are known when its step is planned


def tiered(kv_slots=48, host=64, depth=1, batch_max_tokens=16):
    return Scheduler(SchedulerLimits(kv_slots=kv_slots, max_running=4, batch_max_tokens=batch_max_tokens,
                                     chunked_prefill=True, chunked_prefill_size=8, max_wait_tokens=1,
                                     token_ratio=0.0, max_model_len=64, eos_ids=(2,), pipeline_depth=depth,
                                     prompt_cache=True, host_kv_tokens=host))


def request(rid, prompt_ids, max_new):
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=list(prompt_ids),
                     sampling=SamplingParams(max_new_tokens=max_new), arrival_time=0.0)
    return Request(msg, msg.sampling)


class SimulatedPools:
    """What a worker does with a plan, on contents instead of tensors: moves first, then the
    forward's writes; a reused prefix is checked against the prompt it claims to hold."""

    def __init__(self, s: Scheduler):
        self.gpu = [None] * s.kv.num_slots
        self.host = [None] * s.cache.host.num_slots
        self.rows: dict[int, list[int]] = {}  # row → its sequence (prompt + outputs planned)
        self.reused = 0

    def run(self, plan):
        for m in plan.kv_moves:
            targets = m.host_slots if m.to_host else m.gpu_slots
            assert len(m.gpu_slots) == len(m.host_slots) and len(set(targets)) == len(targets)  # one batched copy
            for g, h in zip(m.gpu_slots, m.host_slots):
                if m.to_host:
                    self.host[h] = self.gpu[g]
                else:
                    self.gpu[g] = self.host[h]
        for new in plan.new:
            for i, slot in enumerate(new.cached_slots):  # the KV the request reads instead of computing
                assert self.gpu[slot] == tuple(new.prompt_ids[: i + 1]), f"{new.request_id}: slot {slot} at {i}"
            self.reused += len(new.cached_slots)
            self.rows[new.row] = list(new.prompt_ids)
        for row, slot in zip(plan.decode_rows, plan.decode_slots):
            seq = self.rows[row]
            seq.append(TOKEN)
            self.gpu[slot] = tuple(seq)
        for chunk in plan.prefill:
            seq = self.rows[chunk.row]
            for i, slot in enumerate(chunk.slots):
                self.gpu[slot] = tuple(seq[: chunk.start + i + 1])


def answer(s, plan):
    rows = list(plan.decode_rows) + [c.row for c in plan.prefill if c.sample]
    return s.on_result(StepResult(step=plan.step, rows=rows, token_ids=[TOKEN] * len(rows)))


def run_to_end(s, pools, depth=1):
    plans = []
    for _ in range(5000):
        while len(plans) < depth:
            p = s.schedule()
            if p is None:
                break
            pools.run(p)
            assert_accounted(s)
            plans.append(p)
        if not plans:
            return
        answer(s, plans.pop(0))
    raise AssertionError("did not finish")


def assert_accounted(s, held: list = ()):
    """GPU slots: free, the tree's, or a live request's own, each once; host slots: free, the tree's or
    `held` (cache.dp_fetch: dropped while a peer replica pinned them)."""
    tree = s.cache.tree
    gpu_tree = [x for n in tree.nodes() if not n.on_host for x in n.slots]
    host_tree = [x for n in tree.nodes() if n.on_host for x in n.slots]
    own = [x for r in s.running.values() for x in r.slots[r.num_cached:]]
    assert sorted(s.kv._free + gpu_tree + own) == list(range(s.kv.num_slots))
    assert sorted(s.cache.host._free + host_tree + list(held)) == list(range(s.cache.host.num_slots))
    assert tree.num_tokens == len(gpu_tree) and tree.host_tokens == len(host_tree)
    for n in tree.nodes():  # GPU nodes are closed upwards; host nodes are never held
        assert not (n.on_host and n.refs), n
        assert n.on_host or n.parent is tree.root or not n.parent.on_host, n


def test_an_evicted_prefix_is_demoted_then_promoted_with_its_kv():
    s = tiered(kv_slots=32, host=64, batch_max_tokens=32)
    pools = SimulatedPools(s)
    first = list(range(100, 120))
    s.add(request("a", first, 2))
    run_to_end(s, pools)
    s.add(request("b", range(200, 225), 2))  # needs the room: a's cached 21 slots go to the host
    run_to_end(s, pools)
    assert s.cache.tree.demoted >= 15 and s.cache.host_tokens >= 15
    s.add(request("c", first + [TOKEN, 55, 56], 2))  # a's next turn: its history comes back from the host
    p = s.schedule()
    assert [m.to_host for m in p.kv_moves][-1] is False
    promoted = p.kv_moves[-1].gpu_slots
    assert p.new[0].cached_slots[-len(promoted):] == promoted
    pools.run(p)  # the promoted slots hold a's contexts (checked), and c computes only the rest
    assert len(p.new[0].cached_slots) == 21 and s.cache.host_hits == len(promoted) > 0
    answer(s, p)
    run_to_end(s, pools)
    assert_accounted(s)


@pytest.mark.parametrize("depth", [1, 2])
def test_multi_turn_traffic_through_both_tiers_reuses_only_correct_kv(depth):
    rng = random.Random(depth)
    s = tiered(kv_slots=48, host=40, depth=depth)
    pools = SimulatedPools(s)
    histories = {c: [1000 * (c + 1) + i for i in range(rng.randint(3, 8))] for c in range(6)}
    n = 0
    for _ in range(40):
        c = rng.randrange(6)
        prompt = histories[c] + [rng.randint(3, 900) for _ in range(rng.randint(1, 6))]
        if len(prompt) > 40:
            prompt = prompt[:6]
        s.add(request(f"r{n}", prompt, rng.randint(1, 4)))
        n += 1
        if rng.random() < 0.5:
            run_to_end(s, pools, depth)
        histories[c] = prompt + [TOKEN]
    run_to_end(s, pools, depth)
    tree = s.cache.tree
    assert tree.demoted > 0 and tree.promoted > 0 and tree.dropped > 0  # both tiers evicted
    assert s.cache.host_hits > 0 and pools.reused == s.cache.hits
    assert all(r.status is Status.FINISHED for r in s.by_id.values())
    s.cache.flush()
    assert tree.num_tokens == 0 and tree.host_tokens == 0
    assert s.kv.num_free == s.kv.num_slots and s.cache.host.num_free == s.cache.host.num_slots


def test_a_demotion_that_cannot_fit_then_a_smaller_one_in_the_same_eviction():
    """A host parent used more recently than its children (a shared system prompt), a GPU entry too big
    for the host pool, then a smaller one: the first demotion takes its candidates back, and the parent,
    queued twice by then, is dropped once (it killed the router with an AttributeError)."""
    from llaunch.runtime.cache.host_tier import TieredPrefixTree
    from llaunch.runtime.cache.kv_allocator import KvAllocator

    gpu, host = KvAllocator(512), KvAllocator(64)
    tree = TieredPrefixTree(gpu, host)

    def insert(tokens):
        slots = gpu.alloc(len(tokens))
        gpu.free(slots[:tree.insert(tokens, slots)])

    shared, b, c, x = (list(range(s, s + 16)) for s in (100, 200, 300, 400))
    insert(shared + b)
    insert(shared + c)  # splits: the shared prefix is the parent of b's and c's tails
    tree.match(shared + [999])  # the shared prefix is used again, after its children
    insert(x)
    tree.evict(tree.num_evictable)  # all four to the host pool (64 tokens)
    insert(list(range(1000, 1080)))  # 80 tokens: more than the host pool holds
    insert(list(range(2000, 2064)))
    evicted = tree.evict(144)
    assert evicted == 144 and gpu.num_free == 512
    held = sum(len(n.slots) for n in tree.nodes() if n.on_host)
    assert held == tree.host_tokens == 64 - host.num_free  # every host slot accounted for
