"""Requests with images wait here, outside the scheduler, until the visual servers (runtime/encoder/) have put
their images' embeddings in the embed cache, so no step is planned before the worker can
read them (the grammar gate's pattern, runtime/router/grammar_gate.py).

A held request's images go to the visual servers as EncodeImages, each image to the replica its hash
picks (so a repeated image meets its cached embeddings); once every replica asked has answered
ImagesReady the request goes to the scheduler with its images' cache blocks (or fails with the
encode's error). The entries stay pinned for it until it ends and every step that could read them has
returned; then the router sends ReleaseImages. Pure logic: no sockets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llaunch.runtime.ipc.messages import ImageRef, ImagesReady, TokenBatch
from llaunch.runtime.router.request import Request
from llaunch.runtime.ipc.encoder import EncodeImages, ReleaseImages


def replica_of(image_hash: str, replicas: int) -> int:
    return int(image_hash[:8], 16) % replicas


@dataclass
class _Held:
    req: Request
    answers: int  # replies still to come
    found: dict[str, ImageRef] = field(default_factory=dict)  # hash → where its embeddings are
    error: Optional[str] = None


class ImageGate:
    def __init__(self, replicas: int, dp_rank: int):
        self.replicas, self.dp_rank = replicas, dp_rank
        self._held: dict[str, _Held] = {}
        self._pinned: set[str] = set()  # request ids the visual servers pin embeddings for
        self._ended: list[tuple[int, str]] = []  # (the last step planned when it ended, request id)
        self.to_send: list[tuple[int, EncodeImages | ReleaseImages]] = []  # (visual replica, message)
        self.queries = self.hits = self.encoded = 0  # since start, for RouterStats

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req: Request) -> bool:
        """Whether `req` must wait for its images' embeddings (then it is held here)."""
        if not req.images or self.replicas == 0:
            return False
        parts: dict[int, list[ImageRef]] = {}
        for im in req.images:
            parts.setdefault(replica_of(im.hash, self.replicas), []).append(im)
        for v, images in parts.items():
            self.to_send.append((v, EncodeImages(request_id=req.id, router=self.dp_rank, images=images)))
        self._held[req.id] = _Held(req, len(parts))
        self._pinned.add(req.id)
        return True

    def on_ready(self, msg: ImagesReady) -> tuple[Optional[Request], Optional[str]]:
        """One replica's answer: the request now free to run, or failed (with why), or (None, None)."""
        held = self._held.get(msg.request_id)
        if held is None:
            return None, None  # aborted meanwhile (its release is on its way)
        held.answers -= 1
        if not msg.error:
            self.queries += len({im.hash for im in msg.images})
            self.hits += msg.hits
        self.encoded += msg.encoded
        if msg.error:
            held.error = held.error or msg.error
        held.found.update({im.hash: im for im in msg.images})
        if held.answers:
            return None, None
        del self._held[msg.request_id]
        req = held.req
        if held.error is not None:
            return req, held.error
        req.images = [ImageRef(hash=im.hash, offset=im.offset, grid=im.grid, replica=held.found[im.hash].replica,
                               blocks=held.found[im.hash].blocks) for im in req.images]
        return req, None

    def abort(self, request_id: str) -> Optional[Request]:
        held = self._held.pop(request_id, None)
        return None if held is None else held.req

    def take_all(self) -> list[Request]:
        """Every held request (the replica is failing them all)."""
        out = [h.req for h in self._held.values()]
        self._held.clear()
        return out

    def ended(self, request_ids, last_planned_step: int) -> None:
        """These requests ended (finished, aborted, failed): release their embeddings once the steps
        planned so far have returned (a worker reads them at the step that admits the request)."""
        self._ended += [(last_planned_step, rid) for rid in request_ids if rid in self._pinned]

    def returned(self, step: int) -> None:
        """Steps up to `step` came back (or none is in flight: pass a large step): queue the releases due."""
        due = [rid for s, rid in self._ended if s <= step]
        if not due:
            return
        self._ended = [(s, rid) for s, rid in self._ended if s > step]
        self._pinned.difference_update(due)
        for v in range(self.replicas):
            self.to_send.append((v, ReleaseImages(router=self.dp_rank, request_ids=due)))


class EndsSeen:
    """The router's sender to the detokenizer: every request's end passes through it (finished, aborted,
    refused, failed), so the image gate learns which embeddings to release."""

    def __init__(self, sender, gate: ImageGate, last_planned):
        self.sender, self.gate, self.last_planned = sender, gate, last_planned

    def send(self, msg) -> None:
        if isinstance(msg, TokenBatch) and self.gate._pinned:
            ended = [d.request_id for d in msg.deltas if d.finish_reason is not None]
            if ended:
                self.gate.ended(ended, self.last_planned())
        self.sender.send(msg)

    def close(self) -> None:
        self.sender.close()
