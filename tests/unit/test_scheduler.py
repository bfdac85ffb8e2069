"""The router's scheduling logic without processes: admission, chunking, KV accounting, abort."""
import pytest

from llaunch.runtime.ipc.messages import StepResult
from unit.scheduler_support import EOS, answer, make, req


def test_prefill_is_chunked_by_budget_and_chunk_size():
    s = make(batch_max_tokens=16, chunk=8)
    s.add(req("a", 20, 4))
    p = s.schedule()
    assert [(c.start, len(c.token_ids), c.sample) for c in p.prefill] == [(0, 8, False)]
    assert p.prefill[0].slots == list(range(8))
    assert answer(s, p) == []
    p = s.schedule()
    assert [(c.start, len(c.token_ids), c.sample) for c in p.prefill] == [(8, 8, False)]
    answer(s, p)
    p = s.schedule()
    assert [(c.start, len(c.token_ids), c.sample) for c in p.prefill] == [(16, 4, True)]
    deltas = answer(s, p)
    assert [(d.request_id, d.token_ids) for d in deltas] == [("a", [7])]
    p = s.schedule()
    assert p.decode_rows == [0] and p.decode_slots == [20] and p.prefill == []


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = make(batch_max_tokens=16, chunked=False)
    s.add(req("a", 12, 4))
    s.add(req("b", 12, 4))
    p = s.schedule()
    assert [(c.row, len(c.token_ids)) for c in p.prefill] == [(0, 12)]  # b does not fit in 16 - 12
    answer(s, p)
    p = s.schedule()  # a decodes (1 token), b's 12 fit in the remaining 15
    assert p.decode_rows == [0] and [(c.row, len(c.token_ids)) for c in p.prefill] == [(1, 12)]


def test_fifo_and_row_limit():
    s = make(max_running=2, batch_max_tokens=64)
    for rid in "abc":
        s.add(req(rid, 4, 2))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a", "b"]
    assert [r.id for r in s.waiting] == ["c"]


def test_admission_reserves_peak_kv_and_never_overcommits():
    # a peaks at 10 + 20 - 1 = 29 cached tokens; with b (4 + 20) beside it the peak is 29 + 23 > 30,
    # so b waits although 20 slots are free now
    s = make(kv_slots=30, batch_max_tokens=64, max_model_len=64)
    s.add(req("a", 10, 20))
    s.add(req("b", 4, 20))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a"]
    answer(s, p)
    steps = 0
    while s.has_work():
        p = s.schedule()
        assert s.kv.num_used <= 30
        answer(s, p)
        steps += 1
        assert steps < 100
    assert s.kv.num_used == 0


def test_peak_estimate_admits_when_finishing_order_makes_room():
    # a: 8 + 9 - 1 = 16 at its peak; b: 8 + 2 - 1 = 9 at its peak, when a holds 7 + 2 = 9:
    # the sum of the peaks (25) exceeds 20, but the true peak is max(16, 9 + 9 = 18) = 18 ≤ 20
    s = make(kv_slots=18, batch_max_tokens=64)
    s.add(req("a", 8, 9))
    s.add(req("b", 8, 2))
    p = s.schedule()
    assert [n.request_id for n in p.new] == ["a", "b"]
    answer(s, p)
    while s.has_work():
        answer(s, s.schedule())
        assert s.kv.num_used <= 18
    s2 = make(kv_slots=17, batch_max_tokens=64)
    s2.add(req("a", 8, 9))
    s2.add(req("b", 8, 2))
    assert [n.request_id for n in s2.schedule().new] == ["a"]


def test_finish_on_eos_length_and_stop_token_frees_everything():
    s = make(batch_max_tokens=64)
    s.add(req("eos", 3, 10))
    s.add(req("len", 3, 2))
    s.add(req("stoptok", 3, 10, stop_token_ids=[9]))
    p = s.schedule()
    rows = {n.request_id: n.row for n in p.new}
    tokens = {rows["eos"]: EOS, rows["len"]: 5, rows["stoptok"]: 9}
    deltas = s.on_result(StepResult(step=p.step, rows=list(tokens), token_ids=list(tokens.values())))
    reasons = {d.request_id: d.finish_reason for d in deltas}
    assert reasons == {"eos": "stop", "len": None, "stoptok": "stop"}
    p = s.schedule()
    assert sorted(p.release_rows) == sorted([rows["eos"], rows["stoptok"]])
    deltas = answer(s, p, token=5)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("len", "length")]
    assert s.kv.num_used == 0 and not s.has_work()


def test_ignore_eos_keeps_generating():
    s = make(batch_max_tokens=64)
    s.add(req("a", 3, 3, ignore_eos=True))
    for _ in range(3):
        deltas = answer(s, s.schedule(), token=EOS)
    assert deltas[0].finish_reason == "length"


def test_abort_frees_kv_at_once_and_mid_step_after_the_step():
    s = make(batch_max_tokens=64)
    s.add(req("a", 5, 10))
    s.add(req("w", 5, 10))
    p = s.schedule()
    answer(s, p)
    used = s.kv.num_used
    assert s.abort("a").finish_reason == "abort"
    assert s.kv.num_used == used - 5
    # abort during a step in flight: the request ends now, its KV returns with the step
    p = s.schedule()
    assert s.abort("w").finish_reason == "abort"
    assert s.kv.num_used == 6
    assert answer(s, p) == []  # the token sampled for the aborted request is dropped
    assert s.kv.num_used == 0
    assert s.abort("unknown") is None
    assert s.abort("w") is None


def test_abort_of_waiting_request():
    s = make(max_running=1, batch_max_tokens=64)
    s.add(req("a", 4, 4))
    s.add(req("b", 4, 4))
    s.schedule()
    assert s.abort("b").finish_reason == "abort"
    assert not s.waiting


def test_max_wait_tokens_batches_admissions():
    s = make(kv_slots=1000, batch_max_tokens=64, max_wait=3)
    s.add(req("a", 4, 50))
    answer(s, s.schedule())
    s.add(req("b", 4, 50))
    admitted_at = None
    for step in range(5):
        p = s.schedule()
        if p.new:
            admitted_at = step
            break
        answer(s, p)
    assert admitted_at == 2  # after 3 decode steps since the last admission


def test_token_ratio_admits_early_when_cache_is_mostly_free():
    s = make(kv_slots=1000, batch_max_tokens=64, max_wait=100, ratio=0.5)
    s.add(req("a", 4, 50))
    answer(s, s.schedule())
    s.add(req("b", 4, 50))
    assert [n.request_id for n in s.schedule().new] == ["b"]


@pytest.mark.parametrize("chunked", [True, False])
def test_many_requests_complete_and_release_every_slot(chunked):
    s = make(kv_slots=200, max_running=5, batch_max_tokens=32, chunked=chunked, chunk=8, max_model_len=64)
    for i in range(20):
        s.add(req(f"r{i}", 3 + (i * 7) % 25, 1 + (i * 5) % 17))
    finished = set()
    for _ in range(2000):
        if not s.has_work():
            break
        p = s.schedule()
        assert len(s.running) <= 5 and s.kv.num_used <= 200
        assert len(p.decode_rows) + sum(len(c.token_ids) for c in p.prefill) <= max(32, len(p.decode_rows))
        finished |= {d.request_id for d in answer(s, p, token=5) if d.finish_reason}
    assert finished == {f"r{i}" for i in range(20)}
    assert s.kv.num_used == 0 and s.kv.num_free == 200


def test_request_larger_than_the_whole_cache_is_rejected_not_queued_forever():
    s = make(kv_slots=10)
    d = s.add(req("big", 8, 5))
    assert d.finish_reason == "error" and not s.has_work()


def test_pipelined_steps_never_plan_past_max_tokens():
    s = make(batch_max_tokens=64, depth=2)
    s.add(req("a", 4, 3))
    p0 = s.schedule()  # prefill: samples output 1
    p1 = s.schedule()  # decode: output 2, planned before output 1 is back
    p2 = s.schedule()  # decode: output 3
    assert p1.decode_rows == [0] and p2.decode_rows == [0]
    assert s.schedule() is None  # 3 outputs planned = max_tokens: nothing more for a
    assert s.steps_in_flight == 3
    got = [answer(s, p, token=t) for p, t in ((p0, 11), (p1, 12), (p2, 13))]
    assert [d[0].token_ids for d in got] == [[11], [12], [13]]
    assert got[-1][0].finish_reason == "length"
    assert s.kv.num_used == 0


def test_pipelined_eos_drops_the_extra_token_and_frees_after_the_step_returns():
    s = make(batch_max_tokens=64, depth=2)
    s.add(req("a", 4, 10))
    p0 = s.schedule()
    p1 = s.schedule()
    deltas = answer(s, p0, token=EOS)
    assert deltas[0].finish_reason == "stop"
    assert s.kv.num_used == 5  # 4 prompt slots + the slot step 1 writes into, still in flight
    assert s.schedule() is None
    assert answer(s, p1, token=5) == []
    assert s.kv.num_used == 0
    assert s.schedule() is None  # the release rides with the next real step
    s.add(req("b", 2, 2))
    assert s.schedule().release_rows == [0]


@pytest.mark.parametrize("depth", [1, 2])
def test_many_requests_pipelined_complete_with_bounded_kv(depth):
    import random
    rng = random.Random(depth)
    s = make(kv_slots=120, max_running=6, batch_max_tokens=24, chunk=8, max_model_len=64, depth=depth)
    for i in range(25):
        s.add(req(f"r{i}", rng.randint(1, 30), rng.randint(1, 20)))
    outputs: dict[str, int] = {}
    finished = set()
    plans = []
    for _ in range(3000):
        if not s.has_work() and not plans:
            break
        while len(plans) < depth:
            p = s.schedule()
            if p is None:
                break
            assert s.kv.num_used <= 120
            plans.append(p)
        p = plans.pop(0)
        token = EOS if rng.random() < 0.05 else 5
        for d in answer(s, p, token=token):
            outputs[d.request_id] = outputs.get(d.request_id, 0) + len(d.token_ids)
            if d.finish_reason:
                finished.add(d.request_id)
    assert finished == {f"r{i}" for i in range(25)}
    assert s.kv.num_used == 0 and not s.running


def test_a_prompt_chunked_over_several_steps_never_overcommits_kv():
    # b decodes (3 slots held after this step, 5 more to come); a's 8-token prompt needs two 4-token
    # chunks, so a starts growing a step late while b keeps growing: at a's decode both hold
    # 3 + 2 + 8 + 1 = 14 slots, one more than the estimate that assumes a grows from the next step
    s = make(kv_slots=13, batch_max_tokens=5, chunk=4)
    s.add(req("b", 2, 7))
    answer(s, s.schedule())
    s.add(req("a", 8, 2))
    finished = set()
    for _ in range(50):
        if not s.has_work():
            break
        p = s.schedule()
        assert s.kv.num_used <= 13
        finished |= {d.request_id for d in answer(s, p) if d.finish_reason}
    assert finished == {"a", "b"} and s.kv.num_used == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_accepted_at_the_kv_limit_is_admitted(depth):
    # peak 5 + 6 - 1 = 10 = every slot: add() accepts it, so an idle scheduler must run it (or add()
    # must reject it), never leave it waiting for good
    s = make(kv_slots=10, batch_max_tokens=64, depth=depth)
    rejected = s.add(req("a", 5, 6))
    assert rejected is not None or s.schedule() is not None


def test_prompt_logprob_positions_per_step_are_capped():
    """A request asking for prompt logprobs prefills at most `prompt_logprob_tokens` positions a step
    (each is a vocabulary-wide float32 row), even without chunked prefill; others are not held back."""
    from dataclasses import replace

    sched = make(kv_slots=256, batch_max_tokens=64, chunked=False, max_model_len=128)
    sched.limits = replace(sched.limits, prompt_logprob_tokens=8)
    sched.add(req("asks", 20, 2, prompt_logprobs=0))
    sched.add(req("plain", 20, 2))
    sizes = []
    for _ in range(4):
        plan = sched.schedule()
        sizes.append({c.row: len(c.token_ids) for c in plan.prefill})
        answer(sched, plan)
    assert sizes == [{0: 8, 1: 20}, {0: 8}, {0: 4}, {}]  # rows: "asks" 0, "plain" 1


def test_admission_refuses_crafted_healing_and_prompt_logprob_fields():
    """What a frontend would never send still cannot reach a worker (an id past the vocabulary would
    index past a row's bitmask there)."""
    from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
    from llaunch.runtime.router.admission import AdmissionLimits, refusal

    limits = AdmissionLimits(vocab_size=100, max_model_len=64, max_stop_strings=4, max_stop_string_chars=16)

    def why(**sp):
        return refusal(AddRequest(request_id="r", frontend=0, prompt_ids=[1, 2], arrival_time=0.0,
                                  sampling=SamplingParams(max_new_tokens=4, **sp)), limits)

    assert why(heal_ids=[3, 99], prompt_logprobs=20) is None
    assert "outside the vocabulary" in why(heal_ids=[3, 100])
    assert "prompt_logprobs" in why(prompt_logprobs=21) and "prompt_logprobs" in why(prompt_logprobs=-2)


def test_admission_takes_ids_past_the_vocabulary_only_as_an_image_s_run():
    """An image's tokens are one id past the vocabulary repeated from its offset; any other such id
    would index past the embedding table in a worker."""
    from llaunch.runtime.ipc.messages import AddRequest, ImageRef, SamplingParams
    from llaunch.runtime.router.admission import AdmissionLimits, refusal

    limits = AdmissionLimits(vocab_size=100, max_model_len=64, max_stop_strings=4, max_stop_string_chars=16)
    image = ImageRef(hash="h", offset=2, grid=[1, 4, 4])

    def why(prompt, images=(image,)):
        return refusal(AddRequest(request_id="r", frontend=0, prompt_ids=prompt, arrival_time=0.0,
                                  sampling=SamplingParams(max_new_tokens=4), images=list(images)), limits)

    assert why([1, 2, 105, 105, 105, 105, 3]) is None
    assert "outside the vocabulary" in why([1, 2, 105, 105, 105, 105, 3, 107])  # a stray id after it
    assert "outside the vocabulary" in why([1, 107, 105, 105, 105, 105, 3])  # before the image's offset
    assert "outside the vocabulary" in why([1, 2, 105, 3], images=())


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    """vLLM's priority: a lower value is admitted first; within one priority, first come first served."""
    s = make(max_running=1, batch_max_tokens=64)
    for rid, priority in [("late", 5), ("a", 0), ("urgent", -3), ("b", 0), ("later", 5), ("c", 0)]:
        assert s.add(req(rid, 4, 1, priority=priority)) is None
    assert [r.id for r in s.waiting] == ["urgent", "a", "b", "c", "late", "later"]
    admitted = []
    while s.waiting or s.num_running:
        plan = s.schedule()
        admitted += [n.request_id for n in plan.new]
        answer(s, plan)
    assert admitted == ["urgent", "a", "b", "c", "late", "later"]
