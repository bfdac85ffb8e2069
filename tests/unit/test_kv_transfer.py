"""KV transfer between a prefill and a decode cache: ZMQ over real TCP sockets (threads and a child
process); the NCCL pairs are in test_nccl_pairing.py. The oracle is the
source cache itself: after a transfer, dst[dst_slots] == src[src_slots] exactly, every other dst slot
unchanged."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import zmq

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.pages import (TransferError, gather_page, page_header, plan_pages, scatter_page,
                                               to_wire)
from llaunch.runtime.kv_transfer.zmq_transport import ZmqKvReceiver, ZmqKvSender

pytestmark = pytest.mark.timeout(300)

SLOTS = 160
LENGTHS = [1, 7, 8, 17, 37]  # one token, odd, exactly a page, a page and one, several pages (page_tokens=8)


def make_cache(seed: int, dtype=torch.float32, layers: int = 3, heads: int = 2, head_dim: int = 8) -> KvCache:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, heads, head_dim, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(SLOTS, heads, head_dim, generator=g).to(dtype) for _ in range(layers)]
    return KvCache(k=k, v=v, req_to_slots=torch.zeros(1, 1, dtype=torch.int32))


def clone(kv: KvCache) -> KvCache:
    return KvCache([t.clone() for t in kv.k], [t.clone() for t in kv.v], kv.req_to_slots)


def shuffled_slot_groups(seed: int, lengths: list[int]) -> list[list[int]]:
    perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed)).tolist()
    groups, at = [], 0
    for n in lengths:
        groups.append(perm[at:at + n])
        at += n
    return groups


def assert_moved(src: KvCache, src_slots: list[int], dst: KvCache, dst_slots: list[int]) -> None:
    for layer in range(len(src.k)):
        assert torch.equal(dst.k[layer][dst_slots], src.k[layer][src_slots])
        assert torch.equal(dst.v[layer][dst_slots], src.v[layer][src_slots])


def assert_untouched(dst: KvCache, before: KvCache, written: list[int]) -> None:
    others = sorted(set(range(SLOTS)) - set(written))
    for layer in range(len(dst.k)):
        assert torch.equal(dst.k[layer][others], before.k[layer][others])
        assert torch.equal(dst.v[layer][others], before.v[layer][others])


def test_pages_cover_the_tokens_in_order():
    assert [(p.first_token, p.num_tokens) for p in plan_pages(17, 8)] == [(0, 8), (8, 8), (16, 1)]
    assert [(p.first_token, p.num_tokens) for p in plan_pages(1, 8)] == [(0, 1)]
    assert plan_pages(0, 8) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_exact_slots(dtype):
    src, dst = make_cache(1, dtype), make_cache(2, dtype)
    before = clone(dst)
    src_slots, dst_slots = shuffled_slot_groups(3, [13])[0], shuffled_slot_groups(4, [13])[0]
    page = gather_page(src, torch.tensor(src_slots))
    assert page.shape == (2, 3, 13, 2, 8) and page.is_contiguous()
    scatter_page(dst, torch.tensor(dst_slots), page)
    assert_moved(src, src_slots, dst, dst_slots)
    assert_untouched(dst, before, dst_slots)


@pytest.fixture
def zmq_pair():
    receiver = ZmqKvReceiver("tcp://127.0.0.1:*", timeout_s=10.0)
    sender = ZmqKvSender(receiver.address, page_tokens=8, window=2, timeout_s=10.0)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zmq_concurrent_transfers_land_exactly(zmq_pair, dtype):
    sender, receiver = zmq_pair
    src, dst = make_cache(1, dtype), make_cache(2, dtype)
    before = clone(dst)
    src_groups, dst_groups = shuffled_slot_groups(5, LENGTHS), shuffled_slot_groups(6, LENGTHS)
    recvs = {}
    for i in range(0, len(LENGTHS), 2):  # these are registered before their KV comes, the rest after
        recvs[i] = receiver.recv(f"r{i}", dst_groups[i], dst)
    sends = [sender.send(f"r{i}", src_groups[i], src) for i in range(len(LENGTHS))]
    time.sleep(0.2)
    for i in range(1, len(LENGTHS), 2):
        recvs[i] = receiver.recv(f"r{i}", dst_groups[i], dst)
    for i in range(len(LENGTHS)):
        recvs[i].result(timeout=10)
        sends[i].result(timeout=10)
        assert recvs[i].tokens_done == sends[i].tokens_done == LENGTHS[i]
        assert_moved(src, src_groups[i], dst, dst_groups[i])
    assert_untouched(dst, before, [s for g in dst_groups for s in g])


def test_zmq_header_mismatch_fails_only_that_request(zmq_pair):
    sender, receiver = zmq_pair
    src, dst = make_cache(1), make_cache(2)
    before = clone(dst)
    src_slots, dst_slots = shuffled_slot_groups(7, [19, 9, 5, 6])[0:4], shuffled_slot_groups(8, [19, 9, 5, 6])
    cases = {  # request -> (source cache, source slots, destination slots, what the error names)
        "good": (src, src_slots[0], dst_slots[0], None),
        "bad-dtype": (make_cache(1, torch.bfloat16), src_slots[1], dst_slots[1], "dtype"),
        "bad-count": (src, src_slots[2], dst_slots[3], "tokens"),
        "bad-shape": (make_cache(1, head_dim=4), src_slots[1], dst_slots[1][:9], "shape"),
    }
    handles = {}
    for rid, (cache, s, d, _) in cases.items():
        handles[rid] = (receiver.recv(rid, d, dst), sender.send(rid, s, cache))
    for rid, (_, s, d, expected) in cases.items():
        recv_handle, send_handle = handles[rid]
        assert recv_handle.wait(10) and send_handle.wait(10)
        if expected is None:
            assert recv_handle.ok and send_handle.ok
            assert_moved(src, s, dst, d)
        else:
            assert expected in recv_handle.error and expected in send_handle.error, (recv_handle, send_handle)
    assert_untouched(dst, before, dst_slots[0])  # a rejected page writes nothing


def test_zmq_sender_gone_mid_transfer_fails_that_request_within_timeout():
    receiver = ZmqKvReceiver("tcp://127.0.0.1:*", timeout_s=0.5)
    sender = ZmqKvSender(receiver.address, page_tokens=8, timeout_s=5.0)
    try:
        src, dst = make_cache(1), make_cache(2)
        (cut_src, ok_src), (cut_dst, ok_dst) = shuffled_slot_groups(9, [20, 11]), shuffled_slot_groups(10, [20, 11])
        cut = receiver.recv("cut", cut_dst, dst)
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)  # a prefill peer that sends its first page, then vanishes
        raw.connect(receiver.address)
        first = plan_pages(len(cut_src), 8)[0]
        header = page_header("cut", first, len(cut_src), src)
        from msgspec.msgpack import encode
        raw.send_multipart([encode(header), to_wire(gather_page(src, torch.tensor(cut_src[:8])))])
        raw.close(linger=1000)
        started = time.monotonic()
        ok = receiver.recv("ok", ok_dst, dst), sender.send("ok", ok_src, src)
        assert cut.wait(5) and time.monotonic() - started < 3
        assert "no KV page" in cut.error and cut.tokens_done == 8
        assert_moved(src, cut_src[:8], dst, cut_dst[:8])
        ok[0].result(5)
        ok[1].result(5)
        assert_moved(src, ok_src, dst, ok_dst)
    finally:
        sender.close()
        receiver.close()


def test_zmq_receiver_gone_fails_the_sender_within_timeout():
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.ROUTER)  # a decode peer that takes one page, then vanishes
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sender = ZmqKvSender(f"tcp://127.0.0.1:{port}", page_tokens=8, window=1, timeout_s=0.5)
    try:
        handle = sender.send("lost", list(range(20)), make_cache(1))
        assert raw.poll(5000)
        raw.recv_multipart()
        raw.close(0)
        started = time.monotonic()
        assert handle.wait(5) and time.monotonic() - started < 3
        assert "no acknowledgement" in handle.error
        with pytest.raises(TransferError):
            handle.result(0)
    finally:
        sender.close()


def _zmq_sender_process(address: str) -> None:
    sender = ZmqKvSender(address, page_tokens=8, window=2, timeout_s=10.0)
    src = make_cache(1, torch.bfloat16)
    handles = [sender.send(f"p{i}", g, src) for i, g in enumerate(shuffled_slot_groups(11, LENGTHS))]
    for h in handles:
        h.result(timeout=10)
    sender.close()


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_zmq_transfer_from_another_process():
    receiver = ZmqKvReceiver("tcp://127.0.0.1:*", timeout_s=10.0)
    try:
        dst = make_cache(2, torch.bfloat16)
        before = clone(dst)
        dst_groups = shuffled_slot_groups(12, LENGTHS)
        handles = [receiver.recv(f"p{i}", g, dst) for i, g in enumerate(dst_groups)]
        child = multiprocessing.get_context("spawn").Process(target=_zmq_sender_process, args=(receiver.address,))
        child.start()
        for h in handles:
            h.result(timeout=30)
        child.join(30)
        assert child.exitcode == 0
        src = make_cache(1, torch.bfloat16)
        for s, d in zip(shuffled_slot_groups(11, LENGTHS), dst_groups):
            assert_moved(src, s, dst, d)
        assert_untouched(dst, before, [s for g in dst_groups for s in g])
    finally:
        receiver.close()

