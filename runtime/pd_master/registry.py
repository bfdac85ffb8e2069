"""The pd_master's view of its prefill and decode instances: registration by heartbeat, expiry, load-aware
pairing and the master's own in-flight count per instance. Pure (the clock is injected), so the tests
drive it without a server or a sleep."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import msgspec

from llaunch.runtime.ipc.pd import Registration

ROLES = ("prefill", "decode")
AFFINITY_SLACK = 4  # requests more than the least loaded instance has that prefix affinity may still pick


class NoHealthyInstance(Exception):
    def __init__(self, role: str):
        super().__init__(f"no healthy {role} instance is registered")
        self.role = role


@dataclass
class Instance:
    registration: Registration
    last_seen: float
    marked_down: bool = False  # a request to it failed; its next heartbeat clears this
    inflight: int = 0  # requests the master sent it and has not finished with
    kv_transfers: int = 0  # prefill: requests whose KV it shipped, and the time that took
    kv_transfer_ms_total: float = 0.0

    @property
    def id(self) -> str:
        return self.registration.id

    @property
    def role(self) -> str:
        return self.registration.role

    @property
    def url(self) -> str:
        return self.registration.url

    @property
    def kv_address(self) -> Optional[str]:
        return self.registration.kv_address

    @property
    def pressure(self) -> int:
        """What load-aware picking minimises: its own queue as last reported plus what we sent since."""
        load = self.registration.load
        return load.running + load.waiting + self.inflight


class InstanceRegistry:
    def __init__(self, heartbeat_timeout_s: float = 3.0, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s  # an instance silent this long (and idle) is dropped from the list
        self._clock = clock
        self._instances: dict[str, Instance] = {}
        self._last_pick: dict[str, str] = {}  # role -> id picked last, for round-robin among equals

    def register(self, registration: Registration) -> Instance:
        """A heartbeat: (re)registers the instance with its current load and makes it healthy again."""
        if registration.role == "decode" and not registration.kv_address:
            raise ValueError(f"decode instance {registration.id!r} registered without kv_address: prefill "
                             "instances would have nowhere to ship its KV")
        if not registration.url.startswith(("http://", "https://")):
            raise ValueError(f"instance {registration.id!r}: url must be http(s)://host:port, got {registration.url!r}")
        now = self._clock()
        instance = self._instances.get(registration.id)
        if instance is None or instance.role != registration.role:
            instance = self._instances[registration.id] = Instance(registration, now)
        instance.registration, instance.last_seen, instance.marked_down = registration, now, False
        self._forget_silent(now)
        return instance

    def healthy(self, instance: Instance) -> bool:
        return not instance.marked_down and self._clock() - instance.last_seen <= self.heartbeat_timeout_s

    def mark_unhealthy(self, instance_id: str) -> None:
        """A request to it failed at the connection: no new requests until it heartbeats again."""
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.marked_down = True

    def healthy_instances(self, role: str) -> list[Instance]:
        return [i for i in self._instances.values() if i.role == role and self.healthy(i)]

    def pick(self, role: str, prefix_key: Optional[str] = None) -> Instance:
        """The healthy instance of `role` with the least pressure; equals take turns (round-robin).
        With a `prefix_key` (requests that share a prompt prefix share it), instances within
        AFFINITY_SLACK of the least pressure are ranked by rendezvous hashing instead, so the same
        prefix keeps landing where its KV is cached while load stays balanced."""
        candidates = self.healthy_instances(role)
        if not candidates:
            raise NoHealthyInstance(role)
        least = min(i.pressure for i in candidates)
        if prefix_key is not None:
            near = [i for i in candidates if i.pressure <= least + max(AFFINITY_SLACK, least // 4)]
            return max(near, key=lambda i: hashlib.blake2b(f"{prefix_key}|{i.id}".encode(), digest_size=8).digest())
        tied = sorted((i for i in candidates if i.pressure == least), key=lambda i: i.id)
        last = self._last_pick.get(role)
        chosen = next((i for i in tied if last is not None and i.id > last), tied[0])
        self._last_pick[role] = chosen.id
        return chosen

    def pick_pair(self, prefix_key: Optional[str] = None) -> tuple[Instance, Instance]:
        """(prefill, decode) for one request, each counted in flight: call `end` on both when done."""
        prefill, decode = self.pick("prefill", prefix_key), self.pick("decode", prefix_key)
        self.begin(prefill)
        self.begin(decode)
        return prefill, decode

    def begin(self, instance: Instance) -> None:
        instance.inflight += 1

    def end(self, instance: Instance) -> None:
        instance.inflight -= 1

    def record_transfer(self, instance: Instance, kv_transfer_ms: float) -> None:
        instance.kv_transfers += 1
        instance.kv_transfer_ms_total += kv_transfer_ms

    def counts(self) -> dict[str, int]:
        """Healthy instances per role."""
        return {role: len(self.healthy_instances(role)) for role in ROLES}

    def snapshot(self) -> list[dict]:
        """What GET /pd/instances lists: every known instance, healthy or not."""
        now = self._clock()
        self._forget_silent(now)
        rows = []
        for i in sorted(self._instances.values(), key=lambda i: (i.role, i.id)):
            r = i.registration
            row = {"id": i.id, "role": i.role, "url": i.url, "kv_address": i.kv_address, "model": r.model,
                   "healthy": self.healthy(i), "load": msgspec.to_builtins(r.load), "inflight": i.inflight,
                   "last_seen_s": round(now - i.last_seen, 3)}
            if i.kv_transfers:
                row["kv_transfers"] = i.kv_transfers
                row["kv_transfer_ms_mean"] = round(i.kv_transfer_ms_total / i.kv_transfers, 3)
            rows.append(row)
        return rows

    def _forget_silent(self, now: float) -> None:
        gone = [k for k, i in self._instances.items()
                if now - i.last_seen > self.forget_after_s and i.inflight == 0]
        for k in gone:
            del self._instances[k]
