"""The decode side's landing, driven directly (no transport): pages before and after their recv,
cancels mid-transfer, links going down, bounded parking. The oracle is the source cache: written
slots equal it exactly, every other slot is unchanged."""
from __future__ import annotations

import time

import pytest
import torch

from llaunch.runtime.kv_transfer.kv_landing import KvLanding
from llaunch.runtime.kv_transfer.pages import gather_page, page_header, plan_pages
from unit.test_kv_transfer import SLOTS, assert_moved, assert_untouched, clone, make_cache, shuffled_slot_groups

pytestmark = pytest.mark.timeout(300)


def page_of(src, src_slots: list[int], request_id: str, index: int, page_tokens: int = 8):
    page = plan_pages(len(src_slots), page_tokens)[index]
    rows = torch.tensor(src_slots[page.first_token:page.first_token + page.num_tokens])
    return page_header(request_id, page, len(src_slots), src), gather_page(src, rows).view(torch.uint8).reshape(-1)


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def landing():
    landing = KvLanding(5.0, max_parked_bytes=1 << 20)
    yield landing
    landing.close()


def test_cancel_mid_transfer_writes_nothing_afterwards(landing):
    src, dst = make_cache(1), make_cache(2)
    before = clone(dst)
    s, d = shuffled_slot_groups(5, [17])[0], shuffled_slot_groups(6, [17])[0]
    handle = landing.register("r", d, dst)
    landing.page(1, *page_of(src, s, "r", 0))
    wait_until(lambda: handle.tokens_done == 8)
    landing.cancel("r")
    landing.page(1, *page_of(src, s, "r", 1))
    landing.page(1, *page_of(src, s, "r", 2))
    assert handle.wait(5) and "cancelled" in handle.error
    later = landing.register("after", [0], dst)  # the landing went past the dropped pages
    landing.page(1, *page_of(src, [1], "after", 0))
    later.result(5)
    assert_moved(src, s[:8], dst, d[:8])
    assert_untouched(dst, before, d[:8] + [0])


def test_a_link_going_down_fails_only_the_transfers_it_carried(landing):
    src, dst = make_cache(1), make_cache(2)
    s, d = shuffled_slot_groups(7, [12, 12, 12, 8, 12]), shuffled_slot_groups(8, [12, 12, 12, 8, 12])
    carried, other, unheard = (landing.register(r, d[i], dst) for i, r in enumerate(["carried", "other", "unheard"]))
    landing.page(1, *page_of(src, s[0], "carried", 0))
    landing.page(2, *page_of(src, s[1], "other", 0))
    landing.page(1, *page_of(src, s[3], "whole", 0))  # a whole transfer, parked before its link goes down
    landing.page(1, *page_of(src, s[4], "partial", 0))  # a part of one
    landing.link_down(1, "sender died")
    assert carried.wait(5) and "KV link 1 down: sender died" in carried.error
    landing.page(2, *page_of(src, s[1], "other", 1))
    landing.page(3, *page_of(src, s[2], "unheard", 0))
    landing.page(3, *page_of(src, s[2], "unheard", 1))
    other.result(5)
    unheard.result(5)  # no link was its link until a page came: another link could carry it
    landing.register("whole", d[3], dst).result(5)
    partial = landing.register("partial", d[4], dst)
    assert partial.wait(5) and "link 1 went down" in partial.error and partial.tokens_done == 8
    for i in (1, 2, 3):
        assert_moved(src, s[i], dst, d[i])


def test_parking_is_bounded_and_a_late_recv_learns_why():
    landing = KvLanding(5.0, max_parked_bytes=4096)  # a page of 8 tokens is 2*3*8*2*8*4 = 3072 bytes
    try:
        src, dst = make_cache(1), make_cache(2)
        s = shuffled_slot_groups(9, [40])[0]
        landing.page(1, *page_of(src, s, "big", 0))
        landing.page(1, *page_of(src, s, "big", 1))
        landing.page(1, *page_of(src, s, "big", 2))  # dropped: the transfer already failed
        late = landing.register("big", list(range(SLOTS - 40, SLOTS)), dst)
        assert late.wait(5) and "parking space (4096 bytes) was full" in late.error
        landing.page(1, *page_of(src, s[:8], "again", 0))  # fits only if the failed one's bytes were given back
        landing.register("again", list(range(8)), dst).result(5)
        assert_moved(src, s[:8], dst, list(range(8)))
    finally:
        landing.close()
