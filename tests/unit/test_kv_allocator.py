import pytest

from llaunch.runtime.cache.kv_allocator import KvAllocator, OutOfSlots


def test_fresh_allocator_hands_out_ascending_slots():
    kv = KvAllocator(8)
    assert kv.alloc(3) == [0, 1, 2]
    assert kv.alloc(2) == [3, 4]
    assert (kv.num_used, kv.num_free) == (5, 3)


def test_freed_slots_are_reused_first_in_order():
    kv = KvAllocator(8)
    a = kv.alloc(3)
    kv.alloc(2)
    kv.free(a)
    assert kv.alloc(2) == [0, 1]
    assert kv.alloc(2) == [2, 5]


def test_over_allocation_raises_and_takes_nothing():
    kv = KvAllocator(4)
    kv.alloc(3)
    with pytest.raises(OutOfSlots, match="asked for 2 KV slots, 1 free of 4"):
        kv.alloc(2)
    assert kv.num_free == 1
    assert kv.alloc(0) == []
