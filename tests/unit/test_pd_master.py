"""The pd_master app served by Hypercorn on real ports, in front of fake prefill and decode instances
(tests/unit/pd_support.py: small Quart apps, and one raw socket server that dies mid-stream), called
with the official openai client and httpx; then the master and config server processes themselves."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx
import openai
import pytest

from llaunch.launcher import supervise
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.pd_master.config_server import Directory, create_config_app
from llaunch.runtime.pd_master.app import MasterSettings, create_master_app
from llaunch.runtime.web.registrar import Registrar
from llaunch.runtime.pd_master.registry import InstanceRegistry
from unit.http_support import wait_for
from unit.pd_support import Clock, FakeDecode, FakePrefill, KvBoard, Loop, dying_decode, new_event

pytestmark = pytest.mark.timeout(300)


class Deployment:
    def __init__(self, loop: Loop, clock: Clock, api_key: Optional[str] = None):
        self.loop, self.board, self.lifecycle = loop, KvBoard(), Lifecycle()
        self.registry = InstanceRegistry(heartbeat_timeout_s=3.0, clock=clock)
        settings = MasterSettings(api_key=api_key, connect_timeout_s=1.0)
        self.url = loop.serve(create_master_app(self.registry, settings, self.lifecycle))
        self.http = httpx.Client(base_url=self.url, timeout=10.0)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=10.0)

    def register(self, role: str, name: str, url: str, kv_address: Optional[str] = None, running: int = 0) -> None:
        body = {"id": name, "role": role, "url": url, "kv_address": kv_address, "model": "m",
                "load": {"running": running, "waiting": 0, "kv_used": 0.0}}
        r = self.http.post("/pd/register", json=body)
        assert r.status_code == 200 and r.json() == {"ok": True, "heartbeat_timeout_s": 3.0}, r.text

    def prefill(self, name: str = "p1", **kw) -> FakePrefill:
        fake = FakePrefill(self.board, name, **kw)
        self.register("prefill", name, self.loop.serve(fake.app))
        return fake

    def decode(self, name: str = "d1", running: int = 0, **kw) -> FakeDecode:
        fake = FakeDecode(self.board, name, **kw)
        self.register("decode", name, self.loop.serve(fake.app), fake.kv_address, running)
        return fake

    def instances(self) -> dict[str, dict]:
        return {i["id"]: i for i in self.http.get("/pd/instances").json()["instances"]}

    def idle(self) -> bool:
        return all(i["inflight"] == 0 for i in self.instances().values())


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _dead_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"  # nothing listens there: connection refused


@pytest.fixture
def loop():
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pd(loop, clock) -> Deployment:
    deployment = Deployment(loop, clock)
    yield deployment
    deployment.http.close()


def test_stream_is_relayed_chunk_by_chunk(pd, loop):
    p, d = pd.prefill(), pd.decode()
    d.gate = loop.run(new_event())
    stream = pd.client.completions.create(model="m", prompt="The capital of France", max_tokens=3, stream=True)
    texts = []
    for part in stream:
        texts.append(part.choices[0].text)
        if texts[-1] == "Paris":  # D holds the rest until we saw this: a buffering relay would hang here
            loop.loop.call_soon_threadsafe(d.gate.set)
    assert texts == ["", "Paris", " is", " nice"]
    [(path, pd_id, body)] = d.requests
    assert path == "/v1/completions" and body["prompt"] == "The capital of France" and body["stream"] is True
    assert p.requests == [("/v1/completions", pd_id, d.kv_address, body)]  # the same body, D's KV address
    wait_for(pd.idle)
    assert d.finished == [pd_id] and d.aborted == []
    row = pd.instances()["p1"]
    assert row["kv_transfers"] == 1 and row["kv_transfer_ms_mean"] == 1.5


def test_non_stream_and_lightllm_routes(pd):
    pd.prefill()
    d = pd.decode()
    out = pd.client.completions.create(model="m", prompt="hi", max_tokens=3)
    assert out.choices[0].text == "Paris is nice" and out.model_extra["served_by"] == "d1"
    chat = pd.http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["text"] == "Paris is nice"
    gen = pd.http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    assert gen.status_code == 200 and gen.headers["content-type"] == "application/json"
    with pd.http.stream("POST", "/generate_stream", json={"inputs": "hi"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) == 5
    assert [path for path, _, _ in d.requests] == ["/v1/completions", "/v1/chat/completions", "/generate",
                                                   "/generate_stream"]
    assert len({pd_id for _, pd_id, _ in d.requests}) == 4  # a fresh pd id per request
    assert pd.http.get("/v1/models").json()["data"][0]["id"] == "d1"
    health = pd.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "prefill": 1, "decode": 1}


@pytest.mark.parametrize("status, expected", [(500, 502), (400, 400)])
def test_prefill_failure_before_any_output(pd, status, expected):
    p = pd.prefill(status=status)
    d = pd.decode()
    with pytest.raises(openai.APIStatusError) as e:
        pd.client.completions.create(model="m", prompt="hi", max_tokens=3)
    assert e.value.status_code == expected
    if status == 400:  # P's bad-request answer, as it sent it
        assert e.value.body["message"] == "prefill says 400"
    else:
        assert e.value.body["code"] == "prefill_failed" and "p1" in e.value.body["message"]
    wait_for(lambda: d.aborted == [p.requests[0][1]])  # D's request was closed: it aborted and freed its KV
    wait_for(pd.idle)
    assert pd.instances()["p1"]["healthy"] is True  # it answered: an error, not a dead instance


def test_prefill_failure_after_the_stream_started(pd):
    pd.prefill(status=503)
    d = pd.decode()
    stream = pd.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.APIError, match="prefill instance p1 failed"):
        for _ in stream:
            pass
    with pd.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and json.loads(lines[0][6:])["choices"][0]["text"] == ""
    assert json.loads(lines[1][6:])["error"]["code"] == "prefill_failed" and lines[2:] == ["data: [DONE]"]
    wait_for(lambda: len(d.aborted) == 2)
    wait_for(pd.idle)


def test_unreachable_prefill_is_marked_down(pd):
    pd.register("prefill", "p-dead", _dead_url())
    d = pd.decode()
    r = pd.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_unreachable"
    assert pd.instances()["p-dead"]["healthy"] is False
    wait_for(lambda: len(d.aborted) == 1)
    r = pd.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_prefill_instance"


def test_unreachable_decode_is_marked_down_and_prefill_never_called(pd):
    p = pd.prefill()
    pd.register("decode", "d-dead", _dead_url(), "tcp://d-dead:7000")
    r = pd.http.post("/v1/chat/completions", json={"messages": [], "stream": True})
    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed"
    assert pd.instances()["d-dead"]["healthy"] is False and p.requests == []
    wait_for(pd.idle)


def test_decode_bad_request_is_relayed_and_prefill_cancelled(pd):
    p = pd.prefill(delay_s=3.0)
    d = pd.decode()
    r = pd.http.post("/v1/completions", json={"prompt": "x", "bad": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad"
    wait_for(lambda: p.cancelled == [d.requests[0][1]], timeout=2.0)  # P's request closed, not waited for
    wait_for(pd.idle)
    assert pd.instances()["d1"]["healthy"] is True and d.finished == []


def test_decode_dying_mid_stream(pd, loop):
    pd.prefill()
    pd.register("decode", "d-dying", loop.serve_raw(dying_decode(2)), "tcp://d-dying:7000")
    survivor = pd.decode("d2", running=5)  # busier: the master tries the dying one first
    stream = pd.client.completions.create(model="m", prompt="hi", stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="decode instance d-dying failed"):
        for part in stream:
            texts.append(part.choices[0].text)
    assert texts == ["w0", "w1"]
    rows = pd.instances()
    assert rows["d-dying"]["healthy"] is False and rows["d2"]["healthy"] is True
    out = pd.client.completions.create(model="m", prompt="hi")  # the next one goes to the survivor
    assert out.model_extra["served_by"] == "d2" and len(survivor.finished) == 1
    wait_for(pd.idle)


def test_client_disconnect_aborts_the_decode(pd, loop):
    p, d = pd.prefill(), pd.decode()
    d.gate = loop.run(new_event())  # never opened: the stream stalls after its first word
    with httpx.stream("POST", pd.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=10) as r:
        for line in r.iter_lines():
            if "Paris" in line:
                break
    wait_for(lambda: d.aborted == [p.requests[0][1]])
    wait_for(pd.idle)


def test_no_instances_and_heartbeat_expiry(pd, clock):
    r = pd.http.get("/health")
    assert r.status_code == 503 and (r.json()["prefill"], r.json()["decode"]) == (0, 0)
    assert pd.http.get("/v1/models").status_code == 503
    assert pd.http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    pd.prefill()
    d = pd.decode()
    assert pd.http.get("/health").status_code == 200
    clock.now += 3.5  # no heartbeat for longer than heartbeat_timeout_s
    rows = pd.instances()
    assert not rows["p1"]["healthy"] and not rows["d1"]["healthy"] and rows["d1"]["last_seen_s"] == 3.5
    assert pd.http.get("/health").status_code == 503
    with pytest.raises(openai.APIStatusError) as e:
        pd.client.completions.create(model="m", prompt="hi")
    assert e.value.status_code == 503 and d.requests == []
    pd.register("prefill", "p1", rows["p1"]["url"])  # heartbeats again
    pd.register("decode", "d1", rows["d1"]["url"], d.kv_address)
    assert pd.client.completions.create(model="m", prompt="hi").choices[0].text == "Paris is nice"


def test_drain_refuses_new_requests_and_finishes_running_ones(pd, loop):
    pd.prefill()
    d = pd.decode()
    d.gate = loop.run(new_event())
    with pd.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = r.iter_lines()
        assert "Paris" in next(line for line in lines if "Paris" in line)
        loop.loop.call_soon_threadsafe(pd.lifecycle.drain, 5.0)
        wait_for(lambda: pd.http.get("/health").status_code == 503)
        refused = pd.http.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        heartbeat = {"id": "p9", "role": "prefill", "url": "http://p9:1"}
        assert pd.http.post("/pd/register", json=heartbeat).status_code == 200  # instances still heartbeat
        loop.loop.call_soon_threadsafe(d.gate.set)
        assert [line for line in lines if line][-1] == "data: [DONE]"
    wait_for(lambda: pd.lifecycle.in_flight == 0)
    assert len(d.requests) == 1 and d.finished == [d.requests[0][1]]


def test_api_key_is_checked_and_forwarded(loop, clock):
    pd = Deployment(loop, clock, api_key="sk-1")
    pd.prefill()
    d = pd.decode()  # registration needs no key
    with pytest.raises(openai.AuthenticationError):
        pd.client.completions.create(model="m", prompt="x")
    keyed = openai.OpenAI(base_url=pd.url + "/v1", api_key="sk-1", max_retries=0, timeout=10.0)
    assert keyed.completions.create(model="m", prompt="x").choices[0].text == "Paris is nice"
    assert d.authorization == ["Bearer sk-1"] and pd.http.get("/health").status_code == 200
    pd.http.close()


def test_bad_registrations_are_refused(pd):
    assert pd.http.post("/pd/register", json={"id": "x", "role": "router", "url": "http://x:1"}).status_code == 400
    assert pd.http.post("/pd/register", json={"id": "x", "role": "decode", "url": "http://x:1"}).status_code == 400
    assert pd.http.post("/pd/register", content=b"{").status_code == 400
    assert pd.instances() == {}


def test_load_aware_pick_over_two_decodes(pd, loop):
    pd.prefill()
    busy, idle = pd.decode("d1", running=4), pd.decode("d2", running=1)
    for _ in range(2):
        assert pd.client.completions.create(model="m", prompt="x").model_extra["served_by"] == "d2"
    # concurrent streams count in flight: with 1 + 3 open at d2 its pressure passes d1's 4. Both hold their
    # streams after the first word, so none ends (and leaves the count) before the last is placed.
    busy.gate, idle.gate = loop.run(new_event()), loop.run(new_event())
    streams = [pd.http.send(pd.http.build_request("POST", "/v1/completions", json={"prompt": "x", "stream": True}),
                            stream=True) for _ in range(4)]
    try:
        assert [len(busy.requests), len(idle.requests)] == [1, 2 + 3]
    finally:
        for gate in (busy.gate, idle.gate):
            loop.loop.call_soon_threadsafe(gate.set)
    for r in streams:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
        r.close()
    wait_for(pd.idle)


def test_config_server_lets_an_instance_find_the_master(pd, loop):
    directory = Directory(heartbeat_timeout_s=3.0)
    config_url = loop.serve(create_config_app(directory))
    master = Registrar("master", "m1", pd.url, None, "m", lambda: {"running": 0, "waiting": 0, "kv_used": 0.0},
                       config_server_url=config_url, interval_s=0.1, extra={"register_url": pd.url})
    fake = FakeDecode(pd.board, "d9")
    decode = Registrar("decode", "d9", loop.serve(fake.app), fake.kv_address, "m",
                       lambda: {"running": 2, "waiting": 1, "kv_used": 0.5}, config_server_url=config_url,
                       interval_s=0.1)
    decode.start()
    master.start()
    try:
        wait_for(lambda: "d9" in pd.instances())
        row = pd.instances()["d9"]
        assert row["healthy"] and row["load"] == {"running": 2, "waiting": 1, "kv_used": 0.5}
        assert set(decode.registered_with) == {config_url + "/register", pd.url + "/pd/register"}
        listing = httpx.get(config_url + "/registry", params={"role": "master"}).json()["entries"]
        assert [(e["id"], e["url"], e["register_url"]) for e in listing] == [("m1", pd.url, pd.url)]
        assert [e["id"] for e in httpx.get(config_url + "/registry").json()["entries"]] == ["d9", "m1"]
        assert httpx.get(config_url + "/registry", params={"role": "x"}).status_code == 400
        assert httpx.post(config_url + "/register", json={"id": "y", "role": "router", "url": "u"}).status_code == 400
    finally:
        master.stop()
        decode.stop()
    assert not master._thread.is_alive() and not decode._thread.is_alive()


def test_registrar_survives_an_absent_target():
    registrar = Registrar("prefill", "p", "http://127.0.0.1:1", None, "m", lambda: 1 / 0,
                          master_url="http://127.0.0.1:1", interval_s=0.05).start()
    time.sleep(0.2)  # its load probe raises every round: logged once, never out of the thread
    assert registrar._thread.is_alive() and registrar.registered_with == []
    registrar.stop()
    with pytest.raises(ValueError):
        Registrar("master", "m", "http://x:1", None, "m", dict, master_url="http://x:2")
    with pytest.raises(ValueError):
        Registrar("decode", "d", "http://x:1", "tcp://x:2", "m", dict, master_url="tcp://x:2")


@pytest.mark.slow
def test_master_and_config_server_processes(compose_config, tmp_path):
    """The real entry points as the launcher starts them: run config file, ProcessReady on the control
    socket, the master on both its URLs and registered with the config server, SIGTERM exit 0."""
    import zmq
    from llaunch.launcher import derive, plan
    from llaunch.launcher.main import run_config_of, write_run_config
    from llaunch.runtime.ipc.messages import LauncherInbound
    from llaunch.runtime.ipc.sockets import Receiver

    http, register, registry = _free_port(), _free_port(), _free_port()
    procs, controls, ctx, allocators = {}, {}, zmq.Context(), []
    try:
        for name, overrides in (("config_server", [f"mode.config_server_port={registry}"]),
                                ("pd_master", [f"server.port={http}", f"mode.pd_master_port={register}",
                                               "mode.config_server_host=127.0.0.1",
                                               f"mode.config_server_port={registry}"])):
            cfg = derive.resolve(compose_config("model=tiny-llama", f"mode={name}", *overrides))
            allocators.append(plan.endpoints_for(cfg))
            graph = plan.plan_graph(cfg, allocators[-1])
            controls[name] = Receiver(ctx, graph.control, LauncherInbound)
            path = write_run_config(run_config_of(cfg, tmp_path / name, graph))
            procs[name] = subprocess.Popen([sys.executable, "-m", supervise.ROLE_MODULES[name], "--config",
                                            str(path), "--name", name], stderr=open(tmp_path / f"{name}.log", "wb"))
        for name, control in controls.items():  # both start at once: the master retries the registry
            ready = control.recv(timeout_ms=30_000)
            assert ready is not None and ready.name == name, (tmp_path / f"{name}.log").read_text()
        assert ready.info == {"url": f"http://127.0.0.1:{http}", "register": f"http://127.0.0.1:{register}"}
        for port in (http, register):  # one app on both binds
            r = httpx.get(f"http://127.0.0.1:{port}/health")
            assert r.status_code == 503 and (r.json()["prefill"], r.json()["decode"]) == (0, 0)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{registry}/registry?role=master").json()["entries"])
        [entry] = httpx.get(f"http://127.0.0.1:{registry}/registry?role=master").json()["entries"]
        assert (entry["url"], entry["register_url"]) == (f"http://127.0.0.1:{http}", f"http://127.0.0.1:{register}")
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(10) for proc in procs.values()] == [0, 0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for a in allocators:
            a.close()
        for control in controls.values():
            control.close()
        ctx.term()
