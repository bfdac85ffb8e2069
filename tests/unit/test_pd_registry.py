"""The pd_master's instance registry on an injected clock: heartbeat expiry, marking down and reviving,
load-aware picking with round-robin among equals, in-flight accounting, and what it refuses."""
from __future__ import annotations

import pytest

from llaunch.runtime.ipc.pd import InstanceLoad, Registration
from llaunch.runtime.pd_master.registry import InstanceRegistry, NoHealthyInstance


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reg(id: str, role: str = "decode", running: int = 0, waiting: int = 0) -> Registration:
    kv = f"tcp://{id}:7000" if role == "decode" else None
    return Registration(id=id, role=role, url=f"http://{id}:8000", kv_address=kv, model="m",
                        load=InstanceLoad(running=running, waiting=waiting, kv_used=0.25))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock) -> InstanceRegistry:
    return InstanceRegistry(heartbeat_timeout_s=3.0, forget_after_s=60.0, clock=clock)


def test_heartbeat_expiry_and_revival(registry, clock):
    registry.register(reg("p", "prefill"))
    registry.register(reg("d"))
    assert registry.counts() == {"prefill": 1, "decode": 1}
    clock.now += 3.0  # exactly the timeout: still healthy
    assert registry.counts() == {"prefill": 1, "decode": 1}
    clock.now += 0.01
    assert registry.counts() == {"prefill": 0, "decode": 0}
    with pytest.raises(NoHealthyInstance) as e:
        registry.pick_pair()
    assert e.value.role == "prefill"
    registry.register(reg("d"))  # a heartbeat makes it healthy again
    assert registry.counts() == {"prefill": 0, "decode": 1}
    rows = {r["id"]: r for r in registry.snapshot()}
    assert rows["p"]["healthy"] is False and rows["p"]["last_seen_s"] == pytest.approx(3.01)
    assert rows["d"] == {"id": "d", "role": "decode", "url": "http://d:8000", "kv_address": "tcp://d:7000",
                         "model": "m", "healthy": True, "load": {"running": 0, "waiting": 0, "kv_used": 0.25},
                         "inflight": 0, "last_seen_s": 0.0}


def test_marked_down_until_next_heartbeat(registry):
    registry.register(reg("d1"))
    registry.register(reg("d2", running=9))
    registry.mark_unhealthy("d1")
    assert [i.id for i in registry.healthy_instances("decode")] == ["d2"]
    assert registry.pick("decode").id == "d2"  # busier, but the only healthy one
    registry.mark_unhealthy("nobody")  # unknown ids are ignored
    registry.register(reg("d1"))
    assert registry.pick("decode").id == "d1"


def test_least_pressure_wins_and_counts_the_masters_inflight(registry):
    registry.register(reg("p", "prefill"))
    registry.register(reg("d1", running=2, waiting=1))
    registry.register(reg("d2", running=1))
    p, d = registry.pick_pair()
    assert (p.id, d.id) == ("p", "d2")
    assert (p.inflight, d.inflight) == (1, 1)  # d2's pressure is now 1 + 1 = 2 < 3
    _, d = registry.pick_pair()
    assert d.id == "d2" and d.pressure == 3
    _, d = registry.pick_pair()  # 3 == 3: a tie, and d2 had the last turn
    assert d.id == "d1" and p.inflight == 3
    registry.end(d)
    registry.end(p)
    assert (d.inflight, p.inflight) == (0, 2)


def test_ties_take_turns(registry):
    for i in ("d3", "d1", "d2"):
        registry.register(reg(i))
    assert [registry.pick("decode").id for _ in range(7)] == ["d1", "d2", "d3", "d1", "d2", "d3", "d1"]
    registry.register(reg("d2", waiting=1))
    assert [registry.pick("decode").id for _ in range(4)] == ["d3", "d1", "d3", "d1"]


def test_reported_load_replaces_the_last(registry):
    registry.register(reg("d1", running=5))
    registry.register(reg("d2", running=3))
    assert registry.pick("decode").id == "d2"
    registry.register(reg("d2", running=8))
    assert registry.pick("decode").id == "d1"


def test_transfers_are_averaged_in_the_listing(registry):
    p = registry.register(reg("p", "prefill"))
    registry.record_transfer(p, 2.0)
    registry.record_transfer(p, 4.0)
    row = registry.snapshot()[0]
    assert (row["kv_transfers"], row["kv_transfer_ms_mean"]) == (2, 3.0)


def test_silent_instances_are_forgotten_unless_busy(registry, clock):
    d1 = registry.register(reg("d1"))
    registry.register(reg("d2"))
    registry.begin(d1)
    clock.now += 61
    registry.register(reg("p", "prefill"))
    assert [r["id"] for r in registry.snapshot()] == ["d1", "p"]  # d1 still has a request in flight
    registry.end(d1)
    assert [r["id"] for r in registry.snapshot()] == ["p"]


def test_role_change_starts_a_fresh_entry(registry):
    d = registry.register(reg("x"))
    registry.begin(d)
    p = registry.register(reg("x", "prefill"))
    assert p is not d and p.inflight == 0 and registry.counts() == {"prefill": 1, "decode": 0}


@pytest.mark.parametrize("bad, message", [
    (Registration(id="d", role="decode", url="http://d:1"), "without kv_address"),
    (Registration(id="p", role="prefill", url="tcp://p:1"), "must be http"),
])
def test_refuses_unusable_registrations(registry, bad, message):
    with pytest.raises(ValueError, match=message):
        registry.register(bad)
    assert registry.snapshot() == []


def test_a_shared_prefix_keeps_its_instance_while_load_allows(registry):
    for name in ("a", "b", "c"):
        registry.register(reg(name))
    keys = [f"system prompt {i}" for i in range(12)]
    first = {k: registry.pick("decode", k).id for k in keys}
    assert all(registry.pick("decode", k).id == first[k] for k in keys)  # same prefix, same instance
    assert len(set(first.values())) > 1  # different prefixes spread over the instances
    key = keys[0]
    favourite = first[key]
    registry.register(reg(favourite, running=10))  # far busier than the others now
    assert registry.pick("decode", key).id != favourite
    registry.register(reg(favourite, running=3))  # within the slack: affinity wins again
    assert registry.pick("decode", key).id == favourite


def test_prefix_key_of_request_bodies():
    from llaunch.runtime.pd_master.app import PREFIX_CHARS, prefix_key

    system = "You are a helpful assistant. " * 60  # longer than PREFIX_CHARS
    chat = lambda q: ('{"model": "m", "messages": [{"role": "system", "content": "%s"}, '  # noqa: E731
                      '{"role": "user", "content": "%s"}]}' % (system, q)).encode()
    assert len(system) > PREFIX_CHARS
    assert prefix_key(chat("Hi")) == prefix_key(chat("What is 2+2?"))  # the shared system prompt decides
    long = "y" * PREFIX_CHARS
    assert prefix_key(b'{"prompt": "a%s"}' % long.encode()) != prefix_key(b'{"prompt": "b%s"}' % long.encode())
    assert prefix_key(b'{"inputs": "%s"}' % long.encode()) == prefix_key(b'{"prompt": "%s"}' % long.encode())
    assert prefix_key(b'{"prompt": "short"}') is None  # too little to cache: load alone decides
    assert prefix_key(b"not json") is None and prefix_key(b'{"model": "m"}') is None
