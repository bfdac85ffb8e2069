"""The scheduler's side of prefill/decode disaggregation: which KV moves, when slots are freed, and
what a failed or abandoned transfer leaves behind (nothing)."""
import time

from llaunch.launcher.supervise import visible_devices
from llaunch.runtime.ipc.messages import CancelKv, KvDone, PdLink, ReceiveKv, SendKv
from llaunch.runtime.router.request import Status
from unit.scheduler_support import answer, make, req

DECODE_KV = "tcp://10.0.0.2:7000"


def test_prefill_instance_sends_all_but_the_last_prompt_token_then_frees():
    s = make(pd_role="prefill", chunk=16, batch_max_tokens=32, prompt_cache=True)
    r = req("a", 10, 1, pd=PdLink(id="x.0", decode_kv=DECODE_KV))
    s.add(r)
    plan = s.schedule()
    assert [c.row for c in plan.prefill] and s.kv.num_used == 10
    assert answer(s, plan) == []  # no token for the client: the decode instance samples the first one
    [send] = s.pd.commands
    assert send == SendKv(request_id="a", pd_id="x.0", slots=r.slots[:9], address=DECODE_KV)
    assert r.status is Status.TRANSFER and s.schedule() is None  # nothing to run meanwhile
    [delta] = s.on_kv_done(KvDone(request_id="a", seconds=0.004))
    assert delta.finish_reason == "kv_sent" and delta.kv_transfer_ms == 4.0
    assert s.cache.evictable == s.kv.num_used == 10  # the prompt stays cached for the next one


def test_failed_send_ends_the_request_with_an_error():
    s = make(pd_role="prefill", chunk=16, batch_max_tokens=32)
    s.add(req("a", 6, 1, pd=PdLink(id="x.0", decode_kv=DECODE_KV)))
    answer(s, s.schedule())
    [delta] = s.on_kv_done(KvDone(request_id="a", error="no acknowledgement"))
    assert delta.finish_reason == "error" and s.kv.num_used == 0


def test_decode_instance_receives_into_slots_then_computes_only_the_last_token():
    s = make(pd_role="decode", chunk=16, batch_max_tokens=32)
    r = req("a", 10, 4, pd=PdLink(id="x.0"))
    s.add(r)
    assert s.schedule() is None  # nothing to prefill: the KV comes from the prefill instance
    s.admit_transfers()
    [recv] = s.pd.commands
    assert recv == ReceiveKv(request_id="a", pd_id="x.0", slots=r.slots, skip=0) and len(r.slots) == 9
    assert s.on_kv_done(KvDone(request_id="a")) == []
    plan = s.schedule()
    [new] = plan.new
    assert new.cached_slots == r.slots[:9]  # the worker maps the received KV to the row
    [chunk] = plan.prefill
    assert chunk.start == 9 and chunk.token_ids == [19] and chunk.sample
    [delta] = answer(s, plan)
    assert delta.token_ids == [7] and r.status is Status.RUNNING


def test_decode_instance_reuses_its_cached_prefix_and_receives_the_rest_into_scratch():
    s = make(pd_role="decode", chunk=16, batch_max_tokens=32, prompt_cache=True)
    s.add(req("warm", 10, 1))  # a normal request leaves its prompt in the tree
    answer(s, s.schedule())
    s.add(req("a", 10, 4, pd=PdLink(id="x.0")))
    s.admit_transfers()
    [recv] = s.pd.commands
    assert recv.skip == 9 and recv.slots == []  # the whole shipped prefix is cached here


def test_failed_or_cancelled_receive_frees_its_slots():
    s = make(pd_role="decode", chunk=16, batch_max_tokens=32)
    s.add(req("a", 10, 4, pd=PdLink(id="x.0")))
    s.add(req("b", 10, 4, pd=PdLink(id="y.0")))
    s.admit_transfers()
    assert s.kv.num_used == 18
    [delta] = s.on_kv_done(KvDone(request_id="a", error="no KV page for 30s"))
    assert delta.finish_reason == "error" and s.kv.num_used == 9
    s.pd.commands.clear()
    assert s.abort("b").finish_reason == "abort"
    assert s.pd.commands == [CancelKv(request_id="b")] and s.kv.num_used == 9  # the worker still writes there
    assert s.on_kv_done(KvDone(request_id="b", error="cancelled")) == []
    assert s.kv.num_used == 0 and not s.has_work()


def test_transfers_count_at_their_peak_at_admission():
    s = make(pd_role="decode", chunk=16, batch_max_tokens=32, kv_slots=40)
    s.add(req("a", 10, 20, pd=PdLink(id="x.0")))  # peak 29
    s.add(req("b", 10, 20, pd=PdLink(id="y.0")))
    s.admit_transfers()
    assert [c.request_id for c in s.pd.commands] == ["a"]  # b would overflow once a decodes to its end
    assert len(s.pd.awaiting) == 1


def test_worker_gpus_count_within_the_launchers_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices([0, 1]) == "0,1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_devices([0]) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert visible_devices([1, 2]) == "5,6"


def test_worker_link_stops_when_a_nccl_transport_is_stuck():
    import pytest
    import torch

    from llaunch.runtime.models.batch import KvCache
    from llaunch.runtime.kv_transfer.link import KvLink, KvTransportStuck

    kv = KvCache(k=[torch.zeros(4, 1, 2)], v=[torch.zeros(4, 1, 2)], req_to_slots=torch.zeros(1, 4, dtype=torch.int32))
    link = KvLink(kv, None, scratch_slot=3)
    assert link.poll() == []

    class Stuck:
        stuck = "an operation of pair 0 never completed (peer died mid-page)"

        def close(self):
            pass

    link.senders["nccl://10.0.0.2:7000"] = Stuck()
    assert not link.busy  # no transfer running: the worker's loop still checks on every message
    with pytest.raises(KvTransportStuck, match="must restart: an operation of pair 0"):
        link.check()
    with pytest.raises(KvTransportStuck, match="must restart: an operation of pair 0"):
        link.poll()


def test_worker_link_pairs_again_after_a_broken_sender(monkeypatch):
    """A decode instance restarted on the same KV address: the next SendKv makes a new sender instead
    of failing on the broken one for good."""
    import torch

    from llaunch.runtime.ipc.messages import SendKv
    from llaunch.runtime.models.batch import KvCache
    from llaunch.runtime.kv_transfer.pages import TransferHandle
    from llaunch.runtime.kv_transfer import link as kv_link

    made = []

    class FakeSender:
        broken, stuck = None, None

        def __init__(self):
            self.closed = False
            made.append(self)

        def send(self, pd_id, slots, kv):
            return TransferHandle(pd_id)

        def close(self):
            self.closed = True

    monkeypatch.setattr(kv_link, "_sender", lambda address, kv, timeout_s: FakeSender())
    kv = KvCache(k=[torch.zeros(4, 1, 2)], v=[torch.zeros(4, 1, 2)], req_to_slots=torch.zeros(1, 4, dtype=torch.int32))
    link = kv_link.KvLink(kv, None, scratch_slot=3)
    msg = lambda rid: SendKv(request_id=rid, pd_id=rid, address="nccl://10.0.0.2:7000", slots=[0, 1])  # noqa: E731
    link.start(msg("r1"))
    link.start(msg("r2"))
    assert len(made) == 1  # one pair per decode address while it works
    made[0].broken = "pair 1: the peer closed the control connection"
    link.start(msg("r3"))
    assert len(made) == 2 and link.senders["nccl://10.0.0.2:7000"] is made[1]
    deadline = time.monotonic() + 5
    while not made[0].closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made[0].closed
    for _ in range(kv_link.MAX_REPAIRS + 2):  # bounded: a NCCL pair's buffers are never freed
        link.senders["nccl://10.0.0.2:7000"].broken = "down again"
        link.start(msg("again"))
    assert len(made) == 1 + kv_link.MAX_REPAIRS


def test_an_idle_pd_worker_stops_on_a_stuck_transport():
    """No transfer running and no message coming: the serve loop still wakes up and ends on a stuck
    NCCL transport (the worker's main then exits at once)."""
    import pytest

    from llaunch.runtime.kv_transfer.link import KvTransportStuck
    from llaunch.runtime.worker.process import serve

    class Plans:
        def __init__(self):
            self.waits = []

        def recv(self, timeout_ms=None):
            assert timeout_ms is not None, "an idle pd worker must not block forever"
            self.waits.append(timeout_ms)
            return None

        def recv_nowait(self):
            return None

    class Link:
        busy = False
        checks = 0

        def check(self):
            Link.checks += 1
            if Link.checks == 3:
                raise KvTransportStuck("KV transport stuck, this instance must restart: pair 1: receiving page 1")

    plans = Plans()
    with pytest.raises(KvTransportStuck, match="receiving page 1"):
        serve(runner=None, plans=plans, results=None, overlap=True, link=Link(), kv_results=None)
    assert len(plans.waits) == 3 and all(w <= 100 for w in plans.waits)
