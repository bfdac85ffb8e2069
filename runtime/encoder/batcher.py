"""The visual server's work: the routers' EncodeImages become jobs; the images of waiting jobs that
the embed cache lacks are encoded together, up to visual.batch_size at a time (one image wanted by
several jobs is encoded once); a job is answered (ImagesReady) once every image of it is in the cache,
pinned for it until its router releases it. An encode that fails fails the jobs that wanted its
images, not the server. Pure logic around an EmbedStore and an encode function: no sockets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from llaunch.runtime.ipc.messages import ImageRef, ImagesReady
from llaunch.runtime.cache.embed_store import EmbedStore, TooLarge
from llaunch.runtime.ipc.encoder import EncodeImages


@dataclass
class Job:
    msg: EncodeImages
    hits: int = 0
    encoded: int = 0
    error: Optional[str] = None
    wanted: dict[str, ImageRef] = field(default_factory=dict)  # hash → image not yet pinned for it

    @property
    def key(self) -> tuple[int, str]:
        return self.msg.router, self.msg.request_id


class VisualBatcher:
    def __init__(self, store: EmbedStore, encode: Callable[[list[ImageRef]], list], batch_size: int,
                 replica: int = 0):
        """`encode(images)`: each image's embeddings as bytes (a uint8 array)."""
        self.store, self.encode, self.batch_size, self.replica = store, encode, batch_size, replica
        self.jobs: list[Job] = []  # waiting for encodes, in arrival order
        self.held: dict[tuple[int, str], list[str]] = {}  # answered jobs → the hashes they pinned
        self.parked: dict[str, object] = {}  # encoded, waiting for room in the cache (pinned entries fill it)
        self.encoded = 0

    def add(self, msg: EncodeImages) -> None:
        job, seen = Job(msg), set()
        for im in msg.images:
            if im.hash in seen:
                continue
            seen.add(im.hash)
            if im.hash in self.store:
                job.hits += 1
                self.store.pin(im.hash, job.key)
            else:
                if im.hash in self.parked or any(im.hash in j.wanted for j in self.jobs):
                    job.hits += 1  # already on its way: not encoded again
                job.wanted[im.hash] = im
        self.jobs.append(job)

    def release(self, router: int, request_ids: list[str]) -> None:
        for rid in request_ids:
            key = (router, rid)
            for h in self.held.pop(key, []):
                self.store.unpin(h, key)
            for job in [j for j in self.jobs if j.key == key]:  # ended before its answer: drop it
                self._unpin(job)
                self.jobs.remove(job)

    @property
    def busy(self) -> bool:
        """Work to do now (not only waiting for a release)."""
        return any(j.wanted.keys() - self.parked.keys() for j in self.jobs) or any(j.error for j in self.jobs)

    def step(self) -> list[tuple[int, ImagesReady]]:
        """Store what was parked, then encode one batch of wanted images; the answers now due, as
        (router, ImagesReady)."""
        for h in list(self.parked):
            if not self._store(h, self.parked[h]):
                return self._answers()  # still no room: encoding more would only park more
            del self.parked[h]
        batch: dict[str, ImageRef] = {}
        for job in self.jobs:
            for h, im in job.wanted.items():
                if len(batch) < self.batch_size and h not in self.parked:
                    batch.setdefault(h, im)
        if batch:
            self._encode(list(batch.values()))
        return self._answers()

    def _encode(self, images: list[ImageRef]) -> None:
        try:
            embeds = self.encode(images)
        except Exception as e:  # a bad image (or an out-of-memory batch) fails its requests, not the server
            # (at visual.tp > 1 too: tower_tp keeps the ranks in step and raises on rank 0 when any failed)
            if len(images) > 1:  # one bad image must not fail the requests batched with it
                for im in images:
                    self._encode([im])
                return
            self._fail({im.hash for im in images}, f"encoding the image failed: {type(e).__name__}: {e}")
            return
        self.encoded += len(images)
        first = {}
        for job in self.jobs:  # the first job that wanted an image is the one it was encoded for
            for h in job.wanted:
                first.setdefault(h, job)
        for im, emb in zip(images, embeds):
            first[im.hash].encoded += 1
            if not self._store(im.hash, emb):
                self.parked[im.hash] = emb

    def _store(self, h: str, emb) -> bool:
        """Put in the cache and pin for the jobs that want it; False when there is no room yet."""
        try:
            stored = self.store.put(h, memoryview(emb))
        except TooLarge as e:
            self._fail({h}, str(e))
            return True
        if not stored:
            if not self.held:  # nothing answered holds the room: no release will come
                self._fail({h}, "the embed cache is too small for the images of the requests waiting together: "
                                "raise visual.embed_cache_mib")
                return True
            return False
        for job in self.jobs:
            if job.wanted.pop(h, None) is not None:
                self.store.pin(h, job.key)
        return True

    def _fail(self, hashes: set[str], error: str) -> None:
        for job in self.jobs:
            if job.error is None and hashes & job.wanted.keys():
                job.error = error

    def _answers(self) -> list[tuple[int, ImagesReady]]:
        out, waiting = [], []
        for job in self.jobs:
            m = job.msg
            if job.error is not None:
                self._unpin(job)
                out.append((m.router, ImagesReady(request_id=m.request_id, images=[], error=job.error)))
            elif job.wanted:
                waiting.append(job)
            else:
                refs = [ImageRef(hash=im.hash, offset=im.offset, grid=im.grid, replica=self.replica,
                                 blocks=self.store.pin(im.hash, job.key)) for im in m.images]
                self.held[job.key] = [im.hash for im in m.images]
                out.append((m.router, ImagesReady(request_id=m.request_id, images=refs, hits=job.hits,
                                                  encoded=job.encoded)))
        self.jobs = waiting
        wanted = {h for j in self.jobs for h in j.wanted}
        self.parked = {h: e for h, e in self.parked.items() if h in wanted}
        return out

    def _unpin(self, job: Job) -> None:
        for im in job.msg.images:
            self.store.unpin(im.hash, job.key)
