"""cache.dp_fetch's pins against the owner's host tier (runtime/cache/host_tier.py, runtime/router/dp_fetch.py):
replica 0's host tier is full, replica 1 pins its slots for a fetch, then replica 0 evicts a GPU node. The
pinned host entry cannot make room (its slots would wait for the pin), so it is kept and the GPU node is
dropped; a flush then drops the pinned entry, whose slots wait for the pin (not free); once the pin is
gone the held slots serve the next demotion even while replica 0's own steps are idle. Every slot of both pools is accounted for throughout. Real index files, no model."""
from llaunch.runtime.cache.host_index import index_bytes
from llaunch.runtime.cache.host_pool import create_pool
from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
from llaunch.runtime.router.dp_fetch import DpFetch
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.tiered_cache import TieredPromptCache

HOST = 16  # one 16-token block: the host tier is full with one demoted prefix


def replicas(tmp_path):
    paths = [str(tmp_path / f"index{d}") for d in range(2)]
    for p in paths:
        create_pool(p, index_bytes(HOST, 2))
    return [TieredPromptCache(KvAllocator(64), HOST, DpFetch(r, paths, HOST)) for r in range(2)]


def request(rid, prompt_ids):
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=list(prompt_ids), sampling=SamplingParams(max_new_tokens=8), arrival_time=0.0)
    return Request(msg, msg.sampling)


def cache_prefix(cache, tokens):
    cache.tree.insert(tokens, cache.kv.alloc(len(tokens)))


def assert_accounted(cache):
    """GPU slots: free or the tree's; host slots: free, the tree's, or held for a peer's pin; each once."""
    tree = cache.tree
    gpu = [x for n in tree.nodes() if not n.on_host for x in n.slots]
    host = [x for n in tree.nodes() if n.on_host for x in n.slots]
    assert sorted(cache.kv._free + gpu) == list(range(cache.kv.num_slots))
    assert sorted(cache.host._free + host + cache.fetch.held) == list(range(HOST))
    assert tree.num_tokens == len(gpu) and tree.host_tokens == len(host)


def test_a_host_slot_pinned_by_the_peer_makes_the_owner_drop_not_crash(tmp_path):
    owner, peer = replicas(tmp_path)
    first, second, third = ([base + i for i in range(16)] for base in (100, 200, 300))
    cache_prefix(owner, first)
    assert owner.tree.evict(16) == 16 and owner.tree.host_tokens == 16 and owner.host.num_free == 0
    owner.take_moves()
    owner.returned()  # the demotion's copy ran: its keys are published
    got = peer.fetch.lend(request("r", first + [7]), 0, 16, 64, peer.kv.alloc)  # the peer pins owner's 16 host slots
    assert len(got) == 16

    cache_prefix(owner, second)
    assert owner.tree.evict(16) == 16  # host tier full and its only entry pinned: second is dropped
    assert owner.tree.match(second)[0] == [] and not owner.tree.host_path  # gone from both tiers
    # first stays cached: dropping it would free no slot while the pin lasts
    assert owner.tree.host_tokens == 16 and owner.fetch.held == [] and owner.host.num_free == 0
    assert_accounted(owner)
    owner.tree.flush()  # dropped all the same: its slots wait for the pin (held, not free)
    assert owner.tree.host_tokens == 0 and len(owner.fetch.held) == 16 and owner.host.num_free == 0
    assert_accounted(owner)

    peer.fetch.admitted("r")
    peer.take_moves()
    peer.returned()  # the peer's copy ran: pins gone; the owner's own steps stay idle
    cache_prefix(owner, third)
    assert owner.tree.evict(16) == 16  # the held slots came back: third is demoted, not dropped
    assert owner.tree.host_tokens == 16 and owner.fetch.held == [] and owner.tree.host_path == []
    owner.tree.match(third)
    assert [len(n.slots) for n in owner.tree.host_path] == [16]
    assert_accounted(owner)
