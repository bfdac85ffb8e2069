"""KV transfer between separately started processes that share no process group: each prefill
process joins the decode process's store and pairs with it (gloo on CPU, the NCCL path's code). The
oracle is the source cache: after a transfer dst[dst_slots] == src[src_slots] exactly, every other
destination slot unchanged; failures name their cause and touch only their own request."""
from __future__ import annotations

import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.pages import TransferError, gather_page, page_header, plan_pages
from llaunch.runtime.kv_transfer.nccl_pairing import PairedKvReceiver, PairedKvSender
from llaunch.runtime.kv_transfer import pair_group
from llaunch.runtime.kv_transfer.pair_group import JoinSteps, host_pairing, join_as_sender
from unit.test_kv_transfer import LENGTHS, assert_moved, assert_untouched, make_cache, shuffled_slot_groups

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CPU = torch.device("cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXTRA = [9, 37]  # per sender: "bad-count" (the receiver allocates 5 slots for its 9 tokens), "cancelled"
CUT = 20  # tokens of a transfer whose sender dies after its first page
LATE = 37  # tokens each live sender sends after the dying ones died


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, *args) -> multiprocessing.Process:
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    return child


# ---- child processes ----------------------------------------------------------------------------


def on(kv: KvCache, device) -> KvCache:
    return KvCache([t.to(device) for t in kv.k], [t.to(device) for t in kv.v], kv.req_to_slots)


def _sender(address: str, tag: str, dtype: str, seed: int, events: dict, device: str) -> None:
    """Sends every transfer of one prefill process; then, once told, one more (the link outlived the
    others' failures); then closes its link."""
    sender = PairedKvSender(address, device, timeout_s=10.0, page_tokens=8)
    sender.wait_joined(30)
    events["joined"].set()
    assert events["start"].wait(60)
    src = on(make_cache(seed, DTYPES[dtype]), device)
    groups = shuffled_slot_groups(seed, LENGTHS + EXTRA + [LATE])
    names = [f"{tag}{i}" for i in range(len(LENGTHS))] + [f"{tag}-bad-count", f"{tag}-cancelled"]
    handles = [sender.send(name, group, src) for name, group in zip(names, groups)]
    for h in handles:
        h.result(timeout=10)  # sent: whether the peer accepted is the receiver's to say
    events["sent"].set()
    assert events["again"].wait(60)
    sender.send(f"{tag}-late", groups[-1], src).result(timeout=10)
    sender.close()


def _dying_sender(address: str, request_id: str, seed: int, before_payload: bool, joined, go, device: str) -> None:
    """Joins, sends the first page of a CUT-token transfer, then dies without closing anything; with
    `before_payload`, after also sending the second page's header (the receiver then waits on the data
    group, not on the control socket)."""
    link = join_as_sender(address, torch.device(device), 10.0, JoinSteps("dying sender"))
    joined.set()
    assert go.wait(60)
    src, slots = on(make_cache(seed), device), shuffled_slot_groups(seed, [CUT])[0]
    first, second = plan_pages(CUT, 8)[:2]
    link.send_control(page_header(request_id, first, CUT, src), "header")
    link.send_data(gather_page(src, torch.tensor(slots[:8], device=device)), "page 0")
    if before_payload:
        link.send_control(page_header(request_id, second, CUT, src), "header")
    time.sleep(0.3)
    os._exit(0)


def _refused_sender(address: str, errors) -> None:
    sender = PairedKvSender(address, CPU, timeout_s=5.0)
    with pytest.raises(TransferError) as failure:
        sender.wait_joined(20)
    errors.put(str(failure.value))
    sender.close()


def _check_default_group_untouched(world, groups_before: int, device: str) -> None:
    assert dist.is_initialized() and dist.group.WORLD is world and dist.get_world_size() == 1
    assert len(dist.distributed_c10d._world.pg_map) == groups_before
    t = torch.full((3,), 2.0, device=device)
    dist.all_reduce(t)  # the default (tensor-parallel) group still works
    assert torch.equal(t.cpu(), torch.full((3,), 2.0))


def _init_default_group(port: int, device: str):
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD, len(dist.distributed_c10d._world.pg_map)


def _receiver_with_default_group(port: int, addresses, device: str) -> None:
    world, groups_before = _init_default_group(port, device)
    receiver = PairedKvReceiver("nccl://127.0.0.1:0", device, timeout_s=10.0)
    addresses.put(receiver.address)
    dst, dst_groups = on(make_cache(2, torch.bfloat16), device), shuffled_slot_groups(4, LENGTHS)
    handles = [receiver.recv(f"t{i}", g, dst) for i, g in enumerate(dst_groups)]
    for h in handles:
        h.result(timeout=20)
    src = make_cache(1, torch.bfloat16)
    for s, d in zip(shuffled_slot_groups(1, LENGTHS), dst_groups):
        assert_moved(src, s, on(dst, "cpu"), d)
    _check_default_group_untouched(world, groups_before, device)
    receiver.close()
    dist.destroy_process_group()


def _sender_with_default_group(port: int, address: str, device: str) -> None:
    world, groups_before = _init_default_group(port, device)
    sender = PairedKvSender(address, device, timeout_s=10.0, page_tokens=8)
    src = on(make_cache(1, torch.bfloat16), device)
    for h in [sender.send(f"t{i}", g, src) for i, g in enumerate(shuffled_slot_groups(1, LENGTHS))]:
        h.result(timeout=20)
    sender.close()
    _check_default_group_untouched(world, groups_before, device)
    dist.destroy_process_group()


# ---- across processes ---------------------------------------------------------------------------

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def shared_receiver_scenario(receiver_device: str, sender_device: str, timeout_s: float,
                             dead_link_errors: tuple[str, ...]) -> PairedKvReceiver:
    """Two prefill processes (fp32 and bf16) and two that die mid-transfer once those joined, all into
    one receiver; the live ones send again after that. Returns the (closed) receiver."""
    receiver = PairedKvReceiver("nccl://127.0.0.1:0", receiver_device, timeout_s=timeout_s)
    try:
        ctx = multiprocessing.get_context("spawn")
        senders = {"a": ("float32", 1), "b": ("bfloat16", 2)}
        events = {tag: {e: ctx.Event() for e in ("joined", "start", "sent", "again")} for tag in senders}
        go, dying_joined = ctx.Event(), [ctx.Event(), ctx.Event()]
        dst = {tag: on(make_cache(10 + seed, DTYPES[dtype]), receiver_device) for tag, (dtype, seed) in senders.items()}
        late_dst = {tag: on(make_cache(30 + seed, DTYPES[dtype]), receiver_device)
                    for tag, (dtype, seed) in senders.items()}
        before = {tag: on(kv, "cpu") for tag, kv in dst.items()}
        # per sender: its transfers, bad-count, cancelled; the dying senders' transfers land in a's cache
        dst_groups = {"a": shuffled_slot_groups(20, LENGTHS + [5, 37, CUT, CUT]),
                      "b": shuffled_slot_groups(21, LENGTHS + [5, 37])}
        cuts = {"cut-after-page": (3, False, dst_groups["a"][-2]), "cut-before-payload": (4, True, dst_groups["a"][-1])}
        children = [spawn(_sender, receiver.address, tag, dtype, seed, events[tag], sender_device)
                    for tag, (dtype, seed) in senders.items()]
        children += [spawn(_dying_sender, receiver.address, rid, seed, before_payload, joined, go, sender_device)
                     for (rid, (seed, before_payload, _)), joined in zip(cuts.items(), dying_joined)]
        # registering starts the idle timeout: not before the (slow to start) processes joined
        assert all(e.wait(60) for e in [events[tag]["joined"] for tag in senders] + dying_joined)
        handles = {}
        for tag in senders:
            for i in range(0, len(LENGTHS), 2):  # registered before their KV comes
                handles[f"{tag}{i}"] = receiver.recv(f"{tag}{i}", dst_groups[tag][i], dst[tag])
            handles[f"{tag}-bad-count"] = receiver.recv(f"{tag}-bad-count", dst_groups[tag][len(LENGTHS)], dst[tag])
            handles[f"{tag}-cancelled"] = receiver.recv(f"{tag}-cancelled", dst_groups[tag][len(LENGTHS) + 1], dst[tag])
            receiver.cancel(f"{tag}-cancelled")
            events[tag]["start"].set()
        for rid, (_, _, slots) in cuts.items():
            handles[rid] = receiver.recv(rid, slots, dst["a"])
        go.set()  # the dying ones send and die only now: the live links exist when a data group gets stuck

        for tag in senders:
            assert events[tag]["sent"].wait(30)  # all its pages went out, the odd ones before their recv()
            for i in range(1, len(LENGTHS), 2):
                handles[f"{tag}{i}"] = receiver.recv(f"{tag}{i}", dst_groups[tag][i], dst[tag])
        for rid in cuts:  # the link broke: at once (socket closed) or after the data group's deadline
            assert handles[rid].wait(timeout_s + 10), f"{rid} never ended"
            cut = handles[rid]
            assert any(e in cut.error for e in dead_link_errors) and cut.tokens_done == 8, cut
        for tag in senders:  # the live links still carry transfers
            handles[f"{tag}-late"] = receiver.recv(f"{tag}-late", list(range(LATE)), late_dst[tag])
            events[tag]["again"].set()
        got = {}
        for tag, (dtype, seed) in senders.items():
            for i in range(len(LENGTHS)):
                handles[f"{tag}{i}"].result(timeout=10)
                assert handles[f"{tag}{i}"].tokens_done == LENGTHS[i]
            bad, cancelled = handles[f"{tag}-bad-count"], handles[f"{tag}-cancelled"]
            assert bad.wait(10) and "transfers 9 tokens, receiver allocated 5" in bad.error, bad
            assert cancelled.wait(10) and "cancelled" in cancelled.error, cancelled
            handles[f"{tag}-late"].result(timeout=20)
            got[tag] = on(dst[tag], "cpu")
            src, src_groups = make_cache(seed, DTYPES[dtype]), shuffled_slot_groups(seed, LENGTHS + EXTRA + [LATE])
            for i in range(len(LENGTHS)):
                assert_moved(src, src_groups[i], got[tag], dst_groups[tag][i])
            assert_moved(src, src_groups[-1], on(late_dst[tag], "cpu"), list(range(LATE)))
        written = [s for g in dst_groups["a"][:len(LENGTHS)] for s in g]
        for rid, (seed, _, slots) in cuts.items():
            assert_moved(make_cache(seed), shuffled_slot_groups(seed, [CUT])[0][:8], got["a"], slots[:8])
            written += slots[:8]
        assert_untouched(got["a"], before["a"], written)  # nothing of bad-count, cancelled, cut's rest landed
        assert_untouched(got["b"], before["b"], [s for g in dst_groups["b"][:len(LENGTHS)] for s in g])
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        states = receiver.link_states()
        assert sorted(states) == [1, 2, 3, 4] and all(s.startswith("down:") for s in states.values()), states
        return receiver
    finally:
        receiver.close()


def test_two_prefill_processes_and_two_dying_ones_share_one_receiver():
    shared_receiver_scenario("cpu", "cpu", timeout_s=10.0, dead_link_errors=("KV link",))  # gloo sees it at once


def _live_sender(address: str, seed: int, device: str, joined) -> None:
    """One prefill process: sends LENGTHS transfers (bf16, 8-token pages), waits for each, closes."""
    sender = PairedKvSender(address, device, timeout_s=10.0, page_tokens=8)
    sender.wait_joined(60)
    joined.set()
    src = on(make_cache(seed, torch.bfloat16), device)
    for h in [sender.send(f"t{i}", g, src) for i, g in enumerate(shuffled_slot_groups(seed, LENGTHS))]:
        h.result(timeout=20)
    sender.close()


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.timeout(600)
def test_nccl_a_sender_dying_between_header_and_payload_marks_the_gpu_stuck():
    """On GPUs a receive posted for a page whose sender died never ends (NCCL cannot abort it:
    pair_group._retire), and other streams of that GPU can stall behind its kernel. Seen on two
    H200s (2026-11-30): the multi-link scenario above hung in a scatter, and the landing thread of
    this one in its side stream's synchronize. So the guarantees here are the ones the engine relies
    on: transfers finished before are intact, the GPU is marked stuck naming the receive (the worker
    then exits at once, runtime/worker/process.py), and it takes no new pairs."""
    receiver = PairedKvReceiver("nccl://127.0.0.1:0", "cuda:1", timeout_s=5.0)
    try:
        ctx = multiprocessing.get_context("spawn")
        dst, dst_groups = on(make_cache(12, torch.bfloat16), "cuda:1"), shuffled_slot_groups(22, LENGTHS)
        live_joined = ctx.Event()
        live = spawn(_live_sender, receiver.address, 2, "cuda:0", live_joined)
        assert live_joined.wait(60)  # registering starts the idle timeout: not before the slow start
        handles = [receiver.recv(f"t{i}", g, dst) for i, g in enumerate(dst_groups)]
        for h in handles:
            h.result(timeout=60)
        live.join(30)
        assert live.exitcode == 0
        got, src = on(dst, "cpu"), make_cache(2, torch.bfloat16)
        for s, d in zip(shuffled_slot_groups(2, LENGTHS), dst_groups):
            assert_moved(src, s, got, d)

        joined, go = ctx.Event(), ctx.Event()
        dying = spawn(_dying_sender, receiver.address, "cut-before-payload", 4, True, joined, go, "cuda:0")
        assert joined.wait(60)
        receiver.recv("cut-before-payload", list(range(CUT)), on(make_cache(14), "cuda:1"))  # float32, as sent
        go.set()
        dying.join(30)
        deadline = time.monotonic() + 30
        while not receiver.stuck and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "receiving page 1 of cut-before-payload" in (receiver.stuck or ""), receiver.stuck
        late = PairedKvSender(receiver.address, "cuda:0", timeout_s=5.0)
        with pytest.raises(TransferError, match="the decode rank refused the pair: .*cut-before-payload"):
            late.wait_joined(20)
        late.close()
    finally:
        receiver.close()


def test_a_device_with_a_stuck_operation_takes_no_new_pairs(monkeypatch):
    monkeypatch.setitem(pair_group.stuck_devices, "cpu", "pair 7 with someone: not complete after 5s")
    receiver = PairedKvReceiver("nccl://127.0.0.1:0", CPU, timeout_s=5.0)
    try:
        assert receiver.stuck == "pair 7 with someone: not complete after 5s"
        sender = PairedKvSender(receiver.address, CPU, timeout_s=5.0)  # this process: refused before connecting
        with pytest.raises(TransferError, match="this process takes no new pairs on cpu: pair 7 with someone"):
            sender.wait_joined(10)
        sender.close()
        errors = multiprocessing.get_context("spawn").Queue()
        child = spawn(_refused_sender, receiver.address, errors)  # another process: refused by the receiver
        assert "the decode rank refused the pair: pair 7 with someone" in errors.get(timeout=30)
        child.join(30)
    finally:
        receiver.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_pairing_leaves_each_side_default_group_alone(device):
    addresses = multiprocessing.get_context("spawn").Queue()
    receiver_device, sender_device = ("cuda:1", "cuda:0") if device == "cuda" else ("cpu", "cpu")
    receiver = spawn(_receiver_with_default_group, free_port(), addresses, receiver_device)
    sender = spawn(_sender_with_default_group, free_port(), addresses.get(timeout=60), sender_device)
    for child in (sender, receiver):
        child.join(60)
        assert child.exitcode == 0


# ---- joining ------------------------------------------------------------------------------------


def test_join_failure_names_the_step_and_fails_the_transfers():
    sender = PairedKvSender(f"nccl://127.0.0.1:{free_port()}", CPU, timeout_s=1.0)  # nobody listens there
    handle = sender.send("r", [1, 2, 3], make_cache(1))
    assert handle.wait(10)
    assert "connecting to the decode rank's store" in handle.error, handle
    with pytest.raises(TransferError, match="connecting to the decode rank's store"):
        sender.wait_joined(0)
    later = sender.send("later", [4], make_cache(1))
    assert later.done() and "connecting" in later.error
    sender.close()


def test_a_join_the_decode_side_never_serves_fails_at_the_named_step():
    store, listener = host_pairing("127.0.0.1", 0, CPU, 5.0)  # a decode rank's endpoints, nobody behind them
    try:
        sender = PairedKvSender(f"nccl://127.0.0.1:{store.port}", CPU, timeout_s=1.0)
        with pytest.raises(TransferError, match=r"\(pair 1\): waiting for the decode rank's welcome failed after"):
            sender.wait_joined(10)
        sender.close()
    finally:
        listener.close()


def test_malformed_address_fails_in_the_caller():
    with pytest.raises(ValueError, match="nccl://host:port"):
        PairedKvSender("tcp://127.0.0.1:1", CPU)


def test_a_join_overdue_inside_nccl_creation_marks_the_gpu_stuck(monkeypatch):
    """Communicator creation has no deadline of its own: a join past its deadline in that step marks
    the GPU stuck (the worker exits); elsewhere, or on the CPU, it only fails the join."""
    monkeypatch.setattr(pair_group, "stuck_devices", {})
    steps = JoinSteps("KV sender nccl://h:1 from cuda:0")
    steps.step, steps.since = "waiting for the decode rank's welcome", time.monotonic() - 60
    pair_group.join_overdue(steps, torch.device("cuda", 0), 10.0)
    assert pair_group.stuck_devices == {}
    steps.step, steps.since = "data group construction (nccl on cuda:0)", time.monotonic() - 3
    pair_group.join_overdue(steps, torch.device("cuda", 0), 10.0)  # only just got there
    assert pair_group.stuck_devices == {}
    steps.since = time.monotonic() - 60
    pair_group.join_overdue(steps, torch.device("cpu"), 10.0)
    assert pair_group.stuck_devices == {}
    pair_group.join_overdue(steps, torch.device("cuda", 0), 10.0)
    assert "NCCL communicator creation never finished" in pair_group.stuck_devices["cuda:0"]
    assert "data group construction" in pair_group.stuck_reason(torch.device("cuda", 0))
