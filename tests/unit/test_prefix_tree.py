"""The radix tree of the prompt cache: exact slots for match/insert/split, reference counts, LRU
eviction order back to the allocator, and a randomized run against a dictionary-of-prefixes oracle."""
import random

import pytest

from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.cache.prefix_tree import PrefixTree


def edges(tree: PrefixTree) -> dict[tuple, tuple]:
    """{path of token edges from the root: slots of the last edge}: the tree's whole shape."""
    out = {}

    def walk(node, path):
        for child in node.children.values():
            p = path + (tuple(child.tokens),)
            out[p] = tuple(child.slots)
            walk(child, p)

    walk(tree.root, ())
    return out


def fresh(num_slots=64):
    kv = KvAllocator(num_slots)
    return kv, PrefixTree(kv)


def test_match_on_an_empty_tree_finds_nothing():
    _, tree = fresh()
    assert tree.match([1, 2, 3]) == ([], tree.root)
    assert tree.match([]) == ([], tree.root)


def test_insert_then_match_whole_partial_and_past_the_end():
    kv, tree = fresh()
    slots = kv.alloc(4)
    assert tree.insert([5, 6, 7, 8], slots) == 0
    assert tree.num_tokens == 4 and tree.num_evictable == 4
    assert tree.match([5, 6, 7, 8])[0] == [0, 1, 2, 3]
    assert tree.match([5, 6, 7, 8, 9, 10])[0] == [0, 1, 2, 3]
    assert tree.match([6, 5])[0] == []
    # a match ending inside an edge splits it there, so that exact prefix can be locked
    got, node = tree.match([5, 6, 99])
    assert got == [0, 1] and node.tokens == [5, 6] and node.slots == [0, 1]
    assert edges(tree) == {((5, 6),): (0, 1), ((5, 6), (7, 8)): (2, 3)}
    assert tree.num_tokens == 4


def test_insert_shares_the_cached_prefix_and_reports_it():
    kv, tree = fresh()
    tree.insert([1, 2, 3, 4], kv.alloc(4))  # slots 0-3
    # a second sequence with the same first two tokens, computed into its own slots 4-8
    assert tree.insert([1, 2, 9, 9, 9], kv.alloc(5)) == 2  # 4 and 5 are duplicates the caller frees
    assert edges(tree) == {((1, 2),): (0, 1), ((1, 2), (3, 4)): (2, 3), ((1, 2), (9, 9, 9)): (6, 7, 8)}
    assert tree.num_tokens == 7
    assert tree.match([1, 2, 9, 9, 9, 1])[0] == [0, 1, 6, 7, 8]
    # a sequence that is a prefix of a cached one: all present, nothing taken
    assert tree.insert([1, 2, 3], [50, 51, 52]) == 3
    assert edges(tree)[((1, 2), (3,))] == (2,) and tree.num_tokens == 7
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        tree.insert([1, 2, 3], [1, 2])


def test_lock_protects_the_path_and_split_keeps_the_count():
    kv, tree = fresh()
    tree.insert([1, 2, 3, 4], kv.alloc(4))  # slots 0-3
    own = kv.alloc(3)  # 4 5 6
    assert tree.insert([1, 2, 7], own) == 2  # [1, 2] | [3, 4], [7]
    kv.free(own[:2])
    _, node = tree.match([1, 2, 3, 4])
    tree.lock(node)
    assert (tree.num_locked, tree.num_evictable) == (4, 1)
    tree.lock(node)  # a second request on the same path counts once
    assert tree.num_locked == 4
    # splitting a locked edge: both halves stay locked, twice
    _, mid = tree.match([1, 2, 3])
    assert mid.tokens == [3] and mid.refs == 2 and mid.children[4].refs == 2
    assert tree.num_locked == 4
    assert tree.evict(10) == 1  # only the unlocked branch [7] goes
    assert kv.alloc(1) == [6]
    tree.unlock(node)
    assert tree.num_locked == 4
    tree.unlock(node)
    assert (tree.num_locked, tree.num_evictable) == (0, 4)
    with pytest.raises(RuntimeError, match="unlock of an unlocked"):
        tree.unlock(node)


def test_evict_frees_least_recently_used_leaves_first():
    kv, tree = fresh(16)
    tree.insert([1, 1], kv.alloc(2))  # 0 1, used at t1
    tree.insert([2, 2, 2], kv.alloc(3))  # 2 3 4, t2
    tree.insert([3], kv.alloc(1))  # 5, t3
    tree.match([1, 1])  # [1, 1] is now the most recent
    assert tree.evict(1) == 3  # the oldest leaf whole: [2, 2, 2]
    assert tree.match([2, 2, 2])[0] == []
    assert tree.evict(1) == 1  # then [3]
    assert tree.evict(5) == 2  # then [1, 1]; nothing more to give
    assert tree.num_tokens == 0 and kv.num_used == 0
    assert kv.alloc(6) == [0, 1, 5, 2, 3, 4]  # freed slots come back most recent first


def test_evict_climbs_to_a_parent_left_without_children():
    kv, tree = fresh(16)
    tree.insert([1, 2, 3], kv.alloc(3))  # slots 0 1 2, clock 1
    own = kv.alloc(3)  # 3 4 5
    assert tree.insert([1, 2, 4], own) == 2  # clock 2: [1, 2] -> [3], [4]; the tree takes 5
    kv.free(own[:2])
    tree.insert([9], kv.alloc(1))  # clock 3: slot 3 again
    tree.match([1, 2, 3])  # clock 4
    # LRU leaves: [4] (2), [9] (3), [3] (4); then [1, 2], childless, at its own clock
    assert tree.evict(1) == 1 and tree.match([1, 2, 4])[0] == [0, 1]
    assert tree.evict(1) == 1 and tree.match([9])[0] == []
    assert tree.evict(2) == 3 and tree.num_tokens == 0
    assert edges(tree) == {} and kv.num_used == 0


def test_flush_frees_every_unlocked_entry_and_keeps_locked_ones():
    kv, tree = fresh(16)
    tree.insert([1, 2, 3], kv.alloc(3))  # 0 1 2
    own = kv.alloc(2)  # 3 4
    assert tree.insert([1, 5], own) == 1
    kv.free(own[:1])
    _, node = tree.match([1, 2])
    tree.lock(node)
    assert tree.flush() == 2  # [3] and [5]; [1, 2] is held
    assert edges(tree) == {((1,),): (0,), ((1,), (2,)): (1,)}  # split edges are not merged back
    tree.unlock(node)
    assert tree.flush() == 2 and tree.num_tokens == 0 and kv.num_used == 0


def oracle_match(oracle: dict[tuple, int], tokens: list[int]) -> list[int]:
    out = []
    while len(out) < len(tokens) and tuple(tokens[: len(out) + 1]) in oracle:
        out.append(oracle[tuple(tokens[: len(out) + 1])])
    return out


def forget(oracle: dict[tuple, int], slots: set[int]) -> None:
    for key in [k for k, v in oracle.items() if v in slots]:
        del oracle[key]


def test_random_operations_against_a_prefix_dictionary():
    """Oracle: {prefix tuple: slot of its last token}, first writer wins, as the tree keeps its own
    slots. The tree's slots plus the free list are always every slot, once."""
    rng = random.Random(0)
    kv, tree = fresh(120)
    oracle: dict[tuple, int] = {}
    locked = []
    for _ in range(1500):
        base = rng.choice([[], [1, 2, 3, 4], [1, 2, 5], [7] * 6])
        tokens = base[: rng.randint(0, len(base))] + [rng.randint(1, 4) for _ in range(rng.randint(0, 6))]
        op = rng.random()
        if op < 0.45:  # a request: reuse the cached prefix, compute the rest, cache the whole
            slots, node = tree.match(tokens)
            assert slots == oracle_match(oracle, tokens)
            tree.lock(node)
            need = len(tokens) - len(slots)
            if kv.num_free + tree.num_evictable >= need:
                before = set(tree.cached_slots())
                if need > kv.num_free:
                    assert tree.evict(need - kv.num_free) >= need - kv.num_free
                forget(oracle, before - set(tree.cached_slots()))
                own = kv.alloc(need)
                assert tree.insert(tokens, slots + own) == len(slots)
                for i in range(len(tokens)):
                    oracle.setdefault(tuple(tokens[: i + 1]), (slots + own)[i])
            tree.unlock(node)
        elif op < 0.7:  # a lookup, sometimes held for a while
            slots, node = tree.match(tokens)
            assert slots == oracle_match(oracle, tokens)
            if rng.random() < 0.5:
                tree.lock(node)
                locked.append(node)
        elif op < 0.85 and locked:
            tree.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            before = set(tree.cached_slots())
            freed = tree.evict(rng.randint(1, 10))
            gone = before - set(tree.cached_slots())
            assert len(gone) == freed
            forget(oracle, gone)
        cached = tree.cached_slots()
        assert len(cached) == len(set(cached)) == tree.num_tokens == len(oracle)
        assert sorted(cached + kv._free) == list(range(120))
        assert tree.num_locked == sum(len(n.tokens) for n in tree.nodes() if n.refs > 0)
        # a lock covers the path: no unlocked node has a locked descendant
        assert all(n.parent is tree.root or n.parent.refs >= n.refs for n in tree.nodes())
    for node in locked:
        tree.unlock(node)
    tree.flush()
    assert tree.num_tokens == 0 and kv.num_free == 120
