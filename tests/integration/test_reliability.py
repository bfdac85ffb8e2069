"""What a hostile or unlucky client meets, on the real process graph over real HTTP: values the worker
cannot hold, fan-out, huge prompts, stray IPC frames, overload, a drain that runs out, a stalled or
stopped worker, leftovers of a killed launcher, and the API key kept out of `ps` and the run dir."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from integration.conftest import start_server
from integration.test_api import metric, wait_idle
from integration.test_supervision import alive
from llaunch.runtime.bootstrap import load_run_config

MODEL = "tiny-qwen2"
KEY = "s3cret-key-for-tests-only"
AUTH = {"Authorization": f"Bearer {KEY}"}


def overrides(tiny_dirs):
    return ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}"]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_dirs):
    """A server whose API key comes from the environment (as a deployment should pass it)."""
    with start_server(tmp_path_factory, "hostile", overrides(tiny_dirs), env={"LLAUNCH_API_KEY": KEY}) as server:
        yield server


def post(server, path: str, body, timeout: float = 60.0) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={**AUTH, "Content-Type": "application/json"})


def greedy(server, prompt: str = "The sky is", max_tokens: int = 12) -> str:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def worker_pid(server) -> int:
    [pid] = [p for p in server.children() if b"llaunch.runtime.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


HOSTILE = [
    # numbers the worker's float32 / int64 tensors cannot hold (each once crashed the worker)
    ('{"model": "tiny-qwen2", "prompt": "x", "temperature": 1e39}', "temperature"),
    ('{"model": "tiny-qwen2", "prompt": "x", "temperature": 1e400}', "temperature"),
    ('{"model": "tiny-qwen2", "prompt": "x", "top_k": 123456789012345678901234567890}', "top_k"),
    ('{"model": "tiny-qwen2", "prompt": "x", "seed": 123456789012345678901234567890}', "seed"),
    ('{"model": "tiny-qwen2", "prompt": [123456789012345678901234567890]}', "prompt"),
    ('{"model": "tiny-qwen2", "prompt": "x", "presence_penalty": -1e300}', "presence_penalty"),
    ('{"inputs": "x", "parameters": {"temperature": 1e39, "do_sample": true}}', "parameters.temperature"),
    # fan-out: one request may not start thousands of engine requests
    (json.dumps({"model": MODEL, "prompt": [[5, 6]] * 300, "max_tokens": 1}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": [[5, 6]] * 100, "n": 16, "max_tokens": 1}), "n"),
    # thousands of long stop strings would slow every token of every request (detokenizer)
    (json.dumps({"model": MODEL, "prompt": "x", "stop": ["stop" * 200] * 2000}), "stop"),
    # a field llaunch does not implement is refused, not ignored
    ('{"model": "tiny-qwen2", "prompt": "x", "suffix": "y"}', "suffix"),
    ('{"model": "tiny-qwen2", "prompt": "x", "prompt_logprobs": 21}', "prompt_logprobs"),  # at most 20
    ('{"model": "tiny-qwen2", "prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    # nesting deep enough to overflow a recursive decoder
    ('{"model": "tiny-qwen2", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", None),
]


def test_hostile_values_get_a_400_naming_the_field_and_nothing_changes(hostile):
    before = greedy(hostile)
    for body, param in HOSTILE:
        path = "/generate" if body.startswith('{"inputs"') else "/v1/completions"
        r = post(hostile, path, body.encode())
        assert r.status_code == 400, (body[:80], r.status_code, r.text[:300])
        assert r.json()["error"]["param"] == param, (body[:80], r.json())
    assert greedy(hostile) == before  # the worker is alive and answers as it did
    assert httpx.get(hostile.url + "/health").json()["running"] == 0  # no phantom request counted


def test_a_huge_prompt_never_holds_up_health(hostile):
    """A body over server.max_body_bytes is refused whole; prompts that fit the body but not the
    context are refused, and tokenizing them runs off the event loop: /health answers first."""
    r = post(hostile, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (20 << 20)}).encode())
    assert r.status_code == 413 and "error" in r.json()
    text = "lorem ipsum dolor sit amet " * 1500  # fits the character bound, not the 512-token context
    done: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            async def big() -> None:
                r = await client.post(hostile.url + "/v1/completions", json={"model": MODEL, "prompt": [text] * 64})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                done.append("big")

            async def health() -> None:
                await asyncio.sleep(0.2)  # the big ones are being tokenized now
                assert (await client.get(hostile.url + "/health")).status_code == 200
                done.append("health")

            await asyncio.gather(*(big() for _ in range(4)), health())

    asyncio.run(run())
    assert done[0] == "health", done


def test_stray_frames_on_ipc_sockets_are_dropped(hostile):
    cfg = load_run_config(str(hostile.run_dir / "config.yaml"))
    [router] = [p for p in cfg.graph.processes if p.role == "router"]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(router.binds["requests"])
    push.send(b"\x00not msgpack at all")
    push.send(msgspec.msgpack.encode({"a": "dict, not a message"}))
    push.send(msgspec.msgpack.encode(["AddRequest", "x"]))  # the right tag, the wrong shape
    push.close(linger=1000)
    ctx.term()
    assert greedy(hostile, "Once upon") == greedy(hostile, "Once upon")
    log = (hostile.run_dir / "logs" / "router.0.log").read_text()
    assert "dropped a frame" in log


def test_the_api_key_is_not_on_a_command_line_nor_in_the_run_dir(hostile):
    assert httpx.post(hostile.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert greedy(hostile)
    for pid in [hostile.proc.pid, *hostile.children()]:
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    for path in hostile.run_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert load_run_config(str(hostile.run_dir / "config.yaml")).server.api_key == "<redacted>"


def test_a_key_given_on_the_command_line_is_redacted_in_the_run_dir(tmp_path):
    import subprocess
    import sys

    from integration.server import REPO

    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "llaunch.launcher.main", "dry_run=true", f"server.api_key={KEY}",
                        f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "overrides.yaml" for p in files) and any(p.name == "config.yaml" for p in files)
    assert not [p for p in files if KEY.encode() in p.read_bytes()]


def test_overload_gets_503_at_once_and_the_admitted_finish(tmp_path_factory, tiny_dirs):
    """10× router.max_running_requests concurrent streams: beyond the running and waiting bounds the
    router refuses at once (503, Retry-After, before the admitted ones finish); the admitted finish
    whole; no KV is left. Also: a launcher killed with -9 left an ipc directory; this launch removes it."""
    stale = Path(tempfile.mkdtemp(prefix="llaunch-"))
    (stale / "owner.lock").touch()  # its owner (the killed launcher) holds no lock any more
    live = Path(tempfile.mkdtemp(prefix="llaunch-"))
    import fcntl
    live_fd = os.open(live / "owner.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(live_fd, fcntl.LOCK_EX)  # a running launcher's
    limits = ["router.max_running_requests=2", "router.max_waiting_requests=2"]
    try:
        with start_server(tmp_path_factory, "overload", overrides(tiny_dirs) + limits) as server:
            assert not stale.exists(), "the stale ipc directory was not removed"
            assert live.exists(), "a live launcher's ipc directory was removed"
            events: list[tuple[str, int]] = []

            async def one(i: int, client: httpx.AsyncClient) -> None:
                body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 48, "stream": True,
                        "ignore_eos": True, "temperature": 0}
                async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        assert r.status_code == 503 and r.headers["Retry-After"]
                        assert json.loads(await r.aread())["error"]["code"] == "overloaded"
                        events.append(("refused", i))
                        return
                    lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
                    events.append(("finished", i))

            async def burst() -> None:
                async with httpx.AsyncClient(timeout=120) as client:
                    await asyncio.gather(*(one(i, client) for i in range(20)))

            asyncio.run(burst())
            refused = [i for kind, i in events if kind == "refused"]
            finished = [i for kind, i in events if kind == "finished"]
            assert len(refused) >= 8 and len(finished) >= 2 and len(refused) + len(finished) == 20
            assert events[0][0] == "refused", "the refusals did not come at once"
            wait_idle(server)
            assert metric(server, "request_success_total") >= 0  # the metrics endpoint still answers
    finally:
        os.close(live_fd)
        for d in (stale, live):
            if d.exists():
                (d / "owner.lock").unlink(missing_ok=True)
                d.rmdir()


def test_drain_timeout_ends_open_streams_with_an_error_event_and_done(tmp_path_factory, tiny_dirs):
    server = start_server(tmp_path_factory, "drain-timeout",
                          overrides(tiny_dirs) + ["server.drain_timeout_s=1"]).wait_healthy()
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 480, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    os.kill(worker_pid(server), signal.SIGSTOP)  # the stream cannot finish within the drain
    server.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data:"):])["error"]
    assert error["code"] == "shutdown" and "drain" in error["message"]
    assert server.proc.wait(timeout=60) == 0
    server.stop()


def test_a_stalled_worker_is_reported_and_requests_time_out(tmp_path_factory, tiny_dirs):
    """router.stall_timeout_s: a worker stopped in the middle of a step (SIGSTOP stands for a kernel
    that never returns) makes /health/ready fail and new requests get 503 at once; the running
    request ends at server.request_timeout_s with a 504; once the worker runs again all is well."""
    keys = ["router.stall_timeout_s=2", "router.on_stall=report", "server.request_timeout_s=3"]
    with start_server(tmp_path_factory, "stall", overrides(tiny_dirs) + keys) as server:
        before = greedy(server, max_tokens=8)
        assert httpx.get(server.url + "/health/live").status_code == 200
        worker = worker_pid(server)
        os.kill(worker, signal.SIGSTOP)
        try:
            r = post(server, "/v1/completions", {"model": MODEL, "prompt": "stuck", "max_tokens": 400,
                                                 "ignore_eos": True})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ready = httpx.get(server.url + "/health/ready")
                if ready.status_code == 503 and ready.json()["error"]["code"] == "engine_stalled":
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"no stall reported: {ready.status_code} {ready.text}")
            assert httpx.get(server.url + "/health/live").status_code == 200
            refused = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "stalled"
            assert metric(server, "engine_stalls_total") == 1 and metric(server, "engine_stalled") == 1
        finally:
            os.kill(worker, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert greedy(server, max_tokens=8) == before
        wait_idle(server)


def test_exit_on_stall_takes_the_graph_down_non_zero(tmp_path_factory, tiny_dirs):
    keys = ["router.stall_timeout_s=2", "router.on_stall=exit"]
    server = start_server(tmp_path_factory, "stall-exit", overrides(tiny_dirs) + keys).wait_healthy()
    children = server.children()
    os.kill(worker_pid(server), signal.SIGSTOP)
    # the graph goes down under the request, which the frontend ends with a 503 before it stops
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 300,
                                                         "ignore_eos": True}, timeout=120)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown", r.text
    assert server.proc.wait(timeout=120) == 1
    out = server.output()
    assert "router.0" in out and "stalled" in out
    assert not [p for p in children if alive(p)], "orphaned graph processes"
    server.stop()


def test_ready_only_once_every_worker_has_loaded(tmp_path_factory, tiny_dirs):
    """A worker whose load is slow (stopped by SIGSTOP as soon as it starts, before torch is even
    imported): the frontend answers and the detokenizer's heartbeat is fresh, yet /health/ready,
    /health, /readiness and /healthz say 503 until the worker has loaded, warmed
    up and reported; /health/live says 200 throughout. They once said 200 seconds before the load."""
    server = start_server(tmp_path_factory, "slow-load", overrides(tiny_dirs))
    worker = None
    deadline = time.monotonic() + 30
    while worker is None and time.monotonic() < deadline:
        try:
            worker = worker_pid(server)
        except (ValueError, OSError):
            time.sleep(0.01)
    assert worker is not None, server.output()
    os.kill(worker, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the frontend serves and the engine's heartbeat is there
            try:
                if httpx.get(server.url + "/metrics", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"the frontend never answered:\n{server.output()}")
        for _ in range(10):
            assert httpx.get(server.url + "/health/live").status_code == 200
            for path in ("/health/ready", "/health", "/readiness"):
                r = httpx.get(server.url + path)
                assert r.status_code == 503 and r.json()["error"]["code"] == "loading", (path, r.text)
                assert r.headers["Retry-After"] == "1", path
            assert httpx.get(server.url + "/healthz").status_code == 503
            time.sleep(0.2)
    finally:
        os.kill(worker, signal.SIGCONT)
    server.wait_healthy()
    for path in ("/health/ready", "/health", "/readiness", "/healthz"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert greedy(server, max_tokens=4)
    server.stop()


def test_a_regex_that_compiles_for_minutes_is_a_400_and_stalls_nothing(tmp_path_factory, tiny_dirs):
    """The issue's `(a|b|c|d|e|f|g|h)*` repeated 300 times (5,400 characters: minutes of compiling)
    under server.max_constraint_compile_s=3: a 400 naming guided_regex within the budget; five more
    such requests whose clients leave after a second (their compiles are abandoned); meanwhile plain completions and /tokenize answer
    promptly (they once timed out for 45 s behind the compile threads) and readiness stays green."""
    keys = ["server.max_constraint_compile_s=3"]
    with start_server(tmp_path_factory, "compile-budget", overrides(tiny_dirs) + keys) as server:
        slow = "(a|b|c|d|e|f|g|h)*"
        answered: list[tuple[int, dict, float]] = []
        prompt: list[tuple[str, float]] = []

        async def run() -> None:
            async with httpx.AsyncClient(headers=AUTH) as client:
                async def waited() -> None:
                    t0 = time.monotonic()
                    r = await client.post(server.url + "/v1/completions", timeout=120, json={
                        "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": slow * 300})
                    answered.append((r.status_code, r.json()["error"], time.monotonic() - t0))

                async def gone(k: int) -> None:
                    with pytest.raises(httpx.ReadTimeout):
                        await client.post(server.url + "/v1/completions", timeout=1, json={
                            "model": MODEL, "prompt": "x", "guided_regex": slow * k})

                async def plain() -> None:
                    await asyncio.sleep(0.5)  # the slow ones are compiling
                    for i in range(6):
                        for path, body in (("/v1/completions", {"model": MODEL, "prompt": f"n{i}", "max_tokens": 3}),
                                           ("/tokenize", {"model": MODEL, "prompt": f"tokenize {i}"}),
                                           ("/health/ready", None)):
                            t0 = time.monotonic()
                            r = await (client.get(server.url + path, timeout=60) if body is None
                                       else client.post(server.url + path, json=body, timeout=60))
                            assert r.status_code == 200, (path, r.text)
                            prompt.append((path, time.monotonic() - t0))
                        await asyncio.sleep(0.5)

                await asyncio.gather(waited(), *(gone(301 + k) for k in range(5)), plain())

        asyncio.run(run())
        [(status, error, seconds)] = answered
        assert (status, error["param"], error["code"]) == (400, "guided_regex", "constraint_too_complex"), error
        assert "server.max_constraint_compile_s" in error["message"]
        assert seconds < 3 + 3, seconds  # the budget, and a margin for a busy machine
        slowest = max(prompt, key=lambda p: p[1])
        assert slowest[1] < 5, slowest
        assert greedy(server) == greedy(server)
