"""The scheduler with the prompt cache on: exact lent slots, eviction order, held prefixes, pipelined
insertion, flush, and slot accounting under random shared-prefix traffic."""
import pytest

from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, StepResult
from llaunch.runtime.router.request import Request
from unit.scheduler_support import EOS, answer, make



def cached(**kw):
    return make(prompt_cache=True, **kw)


def req_ids(rid, prompt_ids, max_new, **sp):
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=list(prompt_ids),
                     sampling=SamplingParams(max_new_tokens=max_new, **sp), arrival_time=0.0)
    return Request(msg, msg.sampling)


def run_to_end(s, token=7, depth=1):
    """Drive the scheduler until idle with `depth` plans in flight; every sampled token is `token`."""
    plans, out = [], {}
    for _ in range(1000):
        while len(plans) < depth:
            p = s.schedule()
            if p is None:
                break
            assert s.kv.num_used <= s.kv.num_slots
            plans.append(p)
        if not plans:
            return out
        for d in answer(s, plans.pop(0), token=token):
            out.setdefault(d.request_id, []).extend(d.token_ids)
    raise AssertionError("did not finish")


def assert_slots_accounted(s):
    """Every slot is free or held by the tree, once."""
    held = s.cache.tree.cached_slots()
    assert sorted(held + s.kv._free) == list(range(s.kv.num_slots))
    assert s.kv.num_used == s.cache.tree.num_tokens == len(held)


def test_prompt_cache_lends_a_finished_sequence_to_the_next_turn():
    s = cached(batch_max_tokens=64)
    s.add(req_ids("a", range(10, 20), 3))
    assert run_to_end(s) == {"a": [7, 7, 7]}
    # prompt (slots 0-9) and the first two outputs (decode slots 10, 11) are cached; nothing is in use
    assert s.kv.num_used == 12 and s.kv_in_use == 0 and s.cache.evictable == 12
    assert_slots_accounted(s)
    s.add(req_ids("b", list(range(10, 20)) + [7, 7, 99, 98], 2))  # the conversation's next turn
    p = s.schedule()
    assert p.new[0].cached_slots == list(range(12))
    assert [(c.start, c.token_ids, c.slots, c.sample) for c in p.prefill] == [(12, [99, 98], [12, 13], True)]
    assert (s.cache.queries, s.cache.hits) == (10 + 14, 12)
    assert s.cache.locked == 12 and s.kv_in_use == 14
    assert answer(s, p)[0].token_ids == [7] and run_to_end(s) == {"b": [7]}
    assert_slots_accounted(s)
    assert s.cache.tree.match(list(range(10, 20)) + [7, 7, 99, 98, 7])[0] == list(range(15))


def test_a_repeated_prompt_still_computes_its_last_token():
    s = cached(batch_max_tokens=64, chunked=False)
    s.add(req_ids("a", range(10, 30), 1))
    run_to_end(s)
    s.add(req_ids("b", range(10, 30), 1))
    p = s.schedule()
    assert p.new[0].cached_slots == list(range(19))
    assert [(c.start, c.token_ids, c.slots) for c in p.prefill] == [(19, [29], [20])]
    assert (s.cache.queries, s.cache.hits) == (40, 19)
    assert answer(s, p)[0].finish_reason == "length"
    assert_slots_accounted(s)  # b's slot 20 was a duplicate of a's slot 19: freed
    assert s.kv.num_used == 20


def test_without_chunking_only_the_uncached_part_must_fit_the_step():
    s = cached(batch_max_tokens=16, chunked=False, max_model_len=64)
    s.add(req_ids("a", range(10, 24), 1))  # 14 tokens fit a 16-token step
    run_to_end(s)
    s.add(req_ids("b", list(range(10, 24)) + [50, 51, 52], 1))  # 17 tokens, 14 of them cached
    p = s.schedule()
    assert [(c.start, len(c.token_ids)) for c in p.prefill] == [(14, 3)]


def test_duplicates_of_a_prefix_cached_meanwhile_go_back_to_the_allocator():
    s = cached(batch_max_tokens=64)
    s.add(req_ids("a", [1, 2, 3, 4], 1))
    s.add(req_ids("b", [1, 2, 3, 5], 1))  # admitted in the same step: nothing cached yet
    p = s.schedule()
    assert [n.cached_slots for n in p.new] == [[], []]
    assert [c.slots for c in p.prefill] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    answer(s, p)
    # a cached [1 2 3 4] in 0-3; b's [1 2 3] duplicates 0-2, so 4 5 6 are freed, 7 holds b's 5
    assert s.cache.tree.match([1, 2, 3, 5])[0] == [0, 1, 2, 7]
    assert_slots_accounted(s)
    assert s.kv.alloc(3) == [4, 5, 6]


def test_eviction_makes_room_least_recently_used_first():
    s = cached(kv_slots=20, batch_max_tokens=64, chunk=64)
    s.add(req_ids("a", [1] * 8, 2))
    run_to_end(s)  # cached: 8 prompt + 1 output in slots 0-8
    s.add(req_ids("b", [2] * 5, 2))
    run_to_end(s)  # cached: slots 9-14
    assert s.kv.num_used == 15 and s.kv_in_use == 0
    s.add(req_ids("c", [3] * 10, 2))  # peak 11 > 5 free: a's entry (the older) is evicted
    p = s.schedule()
    assert p.prefill[0].slots == [0, 1, 2, 3, 4, 5, 6, 7, 8, 15]  # evicted slots are reused first
    assert s.cache.tree.match([1] * 8)[0] == [] and s.cache.tree.match([2] * 5)[0] == [9, 10, 11, 12, 13]
    answer(s, p)
    run_to_end(s)
    assert_slots_accounted(s)


def test_a_held_prefix_is_never_evicted_and_counts_once_at_admission():
    # a caches 20 prompt tokens + 1 output; b and c each reuse those 20 and need 5 own slots at peak:
    # 20 + 5 + 5 = 30 fit 30 slots (50 without sharing); the unheld output entry is evicted for them
    s = cached(kv_slots=30, batch_max_tokens=64)
    prompt = list(range(100, 120))
    s.add(req_ids("a", prompt, 2))
    run_to_end(s, token=8)
    assert s.cache.tokens == 21
    for rid in ("b", "c", "d"):
        s.add(req_ids(rid, prompt + [9], 5))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["b", "c"]  # d would need 35
    assert [n.cached_slots for n in p.new] == [list(range(20))] * 2
    assert s.cache.locked == 20
    answer(s, p, token=9)
    while s.has_work():
        p = s.schedule()
        assert s.kv.num_used <= 30
        assert s.cache.tree.match(prompt)[0] == list(range(20))  # held: never evicted
        answer(s, p, token=9)
    assert_slots_accounted(s)
    assert s.cache.locked == 0 and s.kv_in_use == 0
    assert s.cache.tree.match(prompt + [8])[0] == list(range(20))  # a's output entry made room


def test_pipelined_sequences_join_the_tree_only_when_their_steps_are_back():
    s = cached(batch_max_tokens=64, depth=2)
    s.add(req_ids("a", [1, 2, 3, 4], 10))
    p0, p1 = s.schedule(), s.schedule()  # p1 decodes output 0 into slot 4
    assert answer(s, p0, token=EOS)[0].finish_reason == "stop"
    assert s.cache.tokens == 0  # slot 4 is still being written
    s.add(req_ids("b", [1, 2, 3, 4, 5], 3))
    p2 = s.schedule()
    assert p2.new[0].cached_slots == [] and p2.prefill[0].slots == [5, 6, 7, 8, 9]
    answer(s, p1)
    assert s.cache.tree.match([1, 2, 3, 4, EOS])[0] == [0, 1, 2, 3, 4]
    answer(s, p2)
    run_to_end(s, depth=2)
    assert_slots_accounted(s)


def test_abort_mid_pipeline_frees_the_slot_of_a_token_the_router_never_saw():
    s = cached(batch_max_tokens=64, depth=2)
    s.add(req_ids("a", [1, 2, 3, 4], 10))
    p0, p1 = s.schedule(), s.schedule()
    answer(s, p0, token=5)  # output 0 = 5; p1 (feeding 5 into slot 4) is out
    p2 = s.schedule()  # feeds output 1, unknown here, into slot 5
    s.abort("a")
    answer(s, p1, token=6)  # output 1 = 6 is dropped: the request has ended
    answer(s, p2)
    assert s.cache.tree.match([1, 2, 3, 4, 5, 6])[0] == [0, 1, 2, 3, 4]
    assert_slots_accounted(s)
    assert s.kv.num_used == 5


def test_flush_frees_what_no_request_holds():
    s = cached(batch_max_tokens=64)
    s.add(req_ids("a", [1, 2, 3], 1))
    s.add(req_ids("b", [4, 5, 6], 1))
    run_to_end(s)
    s.add(req_ids("c", [1, 2, 3, 9], 4))
    answer(s, s.schedule())  # c holds [1 2 3]
    assert s.cache.flush() == 3  # b's entry
    assert s.cache.tree.match([4, 5, 6])[0] == [] and s.cache.tree.match([1, 2, 3])[0] == [0, 1, 2]
    run_to_end(s)
    used = s.kv.num_used
    assert used == s.cache.tokens == 3 + 4  # a's [1 2 3]; c's [1 2 3] shared, + [9 7 7 7]
    assert s.cache.flush() == used and s.kv.num_used == 0 and s.cache.tokens == 0


def test_without_the_prompt_cache_nothing_is_shared_or_counted():
    s = make(batch_max_tokens=64)
    for rid in "ab":
        s.add(req_ids(rid, [1, 2, 3, 4], 2))
        run_to_end(s)
    s.add(req_ids("c", [1, 2, 3, 4], 2))
    assert s.schedule().new[0].cached_slots == []
    assert (s.cache.queries, s.cache.hits, s.cache.tokens, s.cache.flush()) == (0, 0, 0, 0)


@pytest.mark.parametrize("depth", [1, 2])
def test_many_shared_prefix_requests_with_eviction_keep_every_slot_accounted(depth):
    import random
    rng = random.Random(10 + depth)
    s = cached(kv_slots=150, max_running=6, batch_max_tokens=24, chunk=8, max_model_len=64, depth=depth)
    systems = [[rng.randint(3, 50) for _ in range(rng.randint(5, 20))] for _ in range(4)]
    for i in range(40):
        prompt = rng.choice(systems) + [rng.randint(3, 50) for _ in range(rng.randint(1, 12))]
        s.add(req_ids(f"r{i}", prompt, rng.randint(1, 12)))
    plans, finished, evicted = [], set(), 0
    for _ in range(5000):
        if not s.has_work() and not plans:
            break
        tokens_before = s.cache.tokens
        while len(plans) < depth:
            p = s.schedule()
            if p is None:
                break
            assert s.kv.num_used <= 150
            for new in p.new:  # a lent prefix is exactly what the tree holds for that prompt
                prompt = s.running[new.row].prompt_ids
                assert new.cached_slots == s.cache.tree.match(prompt[: len(new.cached_slots)])[0]
            plans.append(p)
        evicted += s.cache.tokens < tokens_before  # schedule() evicts when allocation runs short
        p = plans.pop(0)
        rows = list(p.decode_rows) + [c.row for c in p.prefill if c.sample]
        toks = [EOS if rng.random() < 0.05 else rng.randint(3, 6) for _ in rows]
        for d in s.on_result(StepResult(step=p.step, rows=rows, token_ids=toks)):
            if d.finish_reason:
                finished.add(d.request_id)
        held = s.cache.tree.cached_slots()
        owned = [x for r in s.running.values() for x in r.slots[r.num_cached:]]
        assert sorted(held + owned + s.kv._free) == list(range(150))  # no slot lost or shared twice
    assert finished == {f"r{i}" for i in range(40)}
    assert s.cache.hits > 0 and s.cache.locked == 0 and evicted > 0
    assert_slots_accounted(s)
    assert s.cache.flush() > 0 and s.kv.num_used == 0
