"""The visual server's logic without processes: the shared-memory embed cache (LRU, pinned entries never
evicted, what a worker reads back is what was written), the batcher (a repeated image encoded once,
batches of visual.batch_size, a failing encode fails its requests only, waiting for room when pinned
entries fill the cache) and the router's image gate (held until every replica answered, released only
after the steps in flight return)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llaunch.runtime.ipc.messages import AddRequest, ImageRef, SamplingParams
from llaunch.runtime.router.image_gate import ImageGate, replica_of
from llaunch.runtime.router.request import Request
from llaunch.runtime.encoder.batcher import VisualBatcher
from llaunch.runtime.cache.embed_reader import ShmEmbeds, image_tokens
from llaunch.runtime.cache.embed_shm import BLOCK_BYTES
from llaunch.runtime.cache.embed_store import EmbedStore
from llaunch.runtime.ipc.encoder import EncodeImages

HIDDEN = 8


def image(key: str, tokens: int = 4, offset: int = 0) -> ImageRef:
    return ImageRef(hash=key, offset=offset, grid=[1, 2, 2 * tokens], pixels=b"p")  # t*h*w/4 = tokens


def embedding(im: ImageRef) -> torch.Tensor:
    tokens = im.grid[0] * im.grid[1] * im.grid[2] // 4
    return torch.arange(tokens * HIDDEN, dtype=torch.float32).view(tokens, HIDDEN) + int(im.hash, 16)


class Encoder:
    def __init__(self, fail: str = ""):
        self.batches, self.fail = [], fail

    def __call__(self, images):
        self.batches.append([im.hash for im in images])
        if self.fail in [im.hash for im in images]:
            raise RuntimeError("bad pixels")
        return [embedding(im).view(torch.uint8).flatten().numpy() for im in images]


@pytest.fixture
def store(tmp_path):
    s = EmbedStore(str(tmp_path / "embeds"), 3)
    yield s
    s.close()


def test_a_repeated_image_is_encoded_once_and_read_back_by_a_worker(store, tmp_path):
    enc = Encoder()
    b = VisualBatcher(store, enc, batch_size=2)
    b.add(EncodeImages(request_id="a", router=0, images=[image("0a"), image("0b"), image("0a", offset=9)]))
    b.add(EncodeImages(request_id="b", router=0, images=[image("0a")]))
    answers = b.step() + b.step()
    assert enc.batches == [["0a", "0b"]]  # one batch; "0a" of both requests encoded once
    assert [(r, a.request_id, a.hits, a.encoded) for r, a in answers] == [(0, "a", 0, 2), (0, "b", 1, 0)]
    reader = ShmEmbeds([str(tmp_path / "embeds")], image_tokens(2), HIDDEN, torch.float32, torch.device("cpu"), 1.0)
    refs = answers[0][1].images
    assert [im.offset for im in refs] == [0, 0, 9]
    for got, im in zip(reader.embeddings(refs), [image("0a"), image("0b"), image("0a")]):
        torch.testing.assert_close(got, embedding(im))
    b.add(EncodeImages(request_id="c", router=1, images=[image("0b")]))
    assert b.step()[0][1].hits == 1 and len(enc.batches) == 1  # still cached: a hit


def test_pinned_entries_are_not_evicted_and_a_waiting_image_gets_room_on_release(store):
    enc = Encoder()
    b = VisualBatcher(store, enc, batch_size=1)
    big = BLOCK_BYTES // (HIDDEN * 4)  # tokens filling one block
    for i, key in enumerate(("01", "02", "03")):
        b.add(EncodeImages(request_id=f"r{i}", router=0, images=[image(key, big)]))
    assert len([a for _ in range(3) for a in b.step()]) == 3  # the cache's 3 blocks, all pinned
    b.add(EncodeImages(request_id="r3", router=0, images=[image("04", big)]))
    assert b.step() == [] and not b.busy  # encoded, parked until a release makes room
    b.release(0, ["r1"])
    [(_, ready)] = b.step()
    assert ready.request_id == "r3" and "02" not in store and "01" in store and "03" in store
    assert enc.batches == [["01"], ["02"], ["03"], ["04"]]
    with pytest.raises(ValueError, match="visual.embed_cache_mib"):
        store.put("ff", memoryview(np.zeros(4 * BLOCK_BYTES, dtype=np.uint8)))


def test_a_failing_encode_fails_its_requests_only(store):
    b = VisualBatcher(store, Encoder(fail="0b"), batch_size=1)
    b.add(EncodeImages(request_id="ok", router=0, images=[image("0a")]))
    b.add(EncodeImages(request_id="bad", router=0, images=[image("0a"), image("0b")]))
    answers = {a.request_id: a for _, a in b.step() + b.step()}
    assert answers["ok"].error is None
    assert "bad pixels" in answers["bad"].error and answers["bad"].images == []


def test_a_failing_batch_is_encoded_again_one_image_at_a_time(store):
    """One bad image in a batch fails only the requests that sent it: the others' images are encoded
    again alone (a bad clip once failed every request batched with it)."""
    enc = Encoder(fail="0b")
    b = VisualBatcher(store, enc, batch_size=3)
    for rid, key in (("ok", "0a"), ("bad", "0b"), ("ok2", "0c")):
        b.add(EncodeImages(request_id=rid, router=0, images=[image(key)]))
    answers = {a.request_id: a for _, a in b.step()}
    assert answers["ok"].error is None and answers["ok2"].error is None and "bad pixels" in answers["bad"].error
    assert enc.batches == [["0a", "0b", "0c"], ["0a"], ["0b"], ["0c"]]
    assert "0a" in store and "0c" in store and "0b" not in store


def test_the_gate_holds_a_request_until_every_replica_answered_and_releases_after_the_steps(store):
    keys = ["00000000", "00000001"]  # replicas 0 and 1 of 2
    assert [replica_of(k, 2) for k in keys] == [0, 1]
    gate = ImageGate(2, dp_rank=0)
    req = Request(AddRequest(request_id="r", frontend=0, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4),
                             arrival_time=0.0, images=[image(keys[0]), image(keys[1], offset=5)]), SamplingParams(max_new_tokens=4))
    assert gate.hold(req) and [v for v, _ in gate.to_send] == [0, 1]
    servers = [VisualBatcher(store, Encoder(), 4, replica=v) for v in (0, 1)]
    for v, msg in gate.to_send:
        servers[v].add(msg)
    gate.to_send = []
    [(_, first)], [(_, second)] = servers[0].step(), servers[1].step()
    assert gate.on_ready(first) == (None, None) and len(gate) == 1
    released, error = gate.on_ready(second)
    assert released is req and error is None and len(gate) == 0
    assert [(im.replica, im.offset, im.pixels) for im in req.images] == [(0, 0, b""), (1, 5, b"")]
    gate.ended(["r"], last_planned_step=7)
    gate.returned(6)
    assert gate.to_send == []  # step 7 may still read the embeddings
    gate.returned(7)
    assert sorted(v for v, _ in gate.to_send) == [0, 1]
    assert (gate.queries, gate.hits, gate.encoded) == (2, 0, 2)
