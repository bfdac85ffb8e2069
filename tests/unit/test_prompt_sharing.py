"""Diverse mode (router.diverse_mode): requests of one prompt prefill it once. The first computes it,
the others wait until its first token is back, then borrow all but the last prompt token from the
prompt cache; every slot stays accounted for."""
import dataclasses

import pytest

from llaunch.runtime.router.scheduler import Scheduler
from unit.scheduler_support import answer, make
from unit.test_scheduler_prompt_cache import assert_slots_accounted, req_ids, run_to_end

PROMPT = list(range(10, 20))


def diverse(on=True, **kw):
    kw = {"chunk": 16, **kw}
    return Scheduler(dataclasses.replace(make(prompt_cache=True, batch_max_tokens=64, **kw).limits, diverse_mode=on))


def test_samples_of_one_prompt_prefill_it_once():
    s = diverse()
    for rid in "abc":
        s.add(req_ids(rid, PROMPT, 3))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a"]  # b and c wait for a's prompt
    assert [(c.start, len(c.token_ids)) for c in p.prefill] == [(0, 10)]
    answer(s, p)
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["b", "c"]
    assert [n.cached_slots for n in p.new] == [list(range(9))] * 2  # a's prompt, shared while a runs
    assert [(c.start, c.token_ids) for c in p.prefill] == [(9, [19]), (9, [19])]
    assert (s.cache.queries, s.cache.hits) == (30, 18)
    answer(s, p)
    assert run_to_end(s) == {"a": [7], "b": [7, 7], "c": [7, 7]}
    assert_slots_accounted(s)


def test_without_diverse_mode_every_sample_computes_the_prompt():
    s = diverse(on=False)
    for rid in "abc":
        s.add(req_ids(rid, PROMPT, 3))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a", "b", "c"]
    assert [len(c.token_ids) for c in p.prefill] == [10, 10, 10]


def test_a_sample_that_ends_before_its_prompt_is_computed_lets_the_others_run():
    s = diverse()
    for rid in "ab":
        s.add(req_ids(rid, PROMPT, 3))
    p = s.schedule()
    s.abort("a")
    answer(s, p)
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["b"] and p.new[0].cached_slots == list(range(9))  # a's, released
    answer(s, p)
    run_to_end(s)
    assert_slots_accounted(s)


@pytest.mark.parametrize("depth", [1, 2])
def test_groups_of_samples_pipelined_keep_every_slot_accounted(depth):
    s = diverse(depth=depth, kv_slots=128, max_running=6, chunk=4)
    for g in range(5):
        for i in range(3):
            s.add(req_ids(f"{g}.{i}", [g + 3] * (5 + g) + PROMPT, 2 + i, ignore_eos=True))
    out = run_to_end(s, depth=depth)
    assert {rid: len(t) for rid, t in out.items()} == {f"{g}.{i}": 2 + i for g in range(5) for i in range(3)}
    assert_slots_accounted(s)
    assert s.cache.hits >= 5 * 2 * (len(PROMPT) + 4)  # each group's two later samples borrowed its prompt


def test_held_samples_do_not_hold_back_other_prompts():
    """A sample waiting for its prompt is passed over: a request of another prompt behind it starts."""
    s = diverse()
    s.add(req_ids("a", PROMPT, 3))
    s.add(req_ids("b", PROMPT, 3))
    s.add(req_ids("other", list(range(30, 36)), 3))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a", "other"]  # b waits for a's prompt
    answer(s, p)
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["b"] and p.new[0].cached_slots == list(range(9))
    answer(s, p)
    run_to_end(s)
    assert_slots_accounted(s)
