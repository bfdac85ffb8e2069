"""Supervision of the real process graph: a dead worker takes everything down, SIGTERM drains,
a client that goes away frees its KV."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from integration.conftest import start_server
from llaunch.runtime.bootstrap import load_run_config
from integration.server import port_is_free
from integration.test_api import wait_idle

MODEL = "tiny-qwen2"


def overrides(tiny_dirs):
    return ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}"]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_killed_worker_tears_down_the_graph(tmp_path_factory, tiny_dirs):
    server = start_server(tmp_path_factory, "kill", overrides(tiny_dirs)).wait_healthy()
    started = server.output()  # piped: a line per start-up stage, before the process says ready
    [serving] = [line for line in started.splitlines() if "llaunch serving" in line]
    assert len(serving) > 80 and serving.rstrip().endswith("/logs)")  # whole, not wrapped at 80 columns
    assert 0 <= started.index("worker.0.0: loading weights (safetensors, float32)") \
        < started.index("worker.0.0: sizing the KV cache") < started.index("ready worker.0.0")
    children = server.children()
    assert len(children) == 4  # worker, router, detokenizer, frontend
    worker = [p for p in children if b"llaunch.runtime.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(worker) == 1
    t0 = time.monotonic()
    os.kill(worker[0], signal.SIGKILL)
    server.proc.wait(timeout=10)
    assert time.monotonic() - t0 < 10
    assert server.proc.returncode not in (0, None)
    out = server.output()
    assert "worker.0.0" in out and "exited" in out
    assert not [p for p in children if alive(p)], "orphaned graph processes"
    assert port_is_free(server.port)
    server.stop()


def test_streams_cut_by_a_dead_process_end_with_an_error_event(tmp_path_factory, tiny_dirs):
    """The router dies under open streams: the launcher tears the graph down, and each stream ends with
    its dialect's error event (OpenAI's then `data: [DONE]`; LightLLM's `data:{"error": ...}`), where
    they once stopped after their last chunk with neither."""
    server = start_server(tmp_path_factory, "cut", overrides(tiny_dirs)).wait_healthy()
    children = server.children()
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in children}
    [worker] = [p for p, cmd in names.items() if b"llaunch.runtime.worker" in cmd]
    [router] = [p for p, cmd in names.items() if b"llaunch.runtime.router" in cmd]
    lines: dict[str, list[str]] = {"openai": [], "lightllm": []}
    started = threading.Barrier(3)
    bodies = {"openai": ("/v1/completions", {"model": MODEL, "prompt": "long", "max_tokens": 480, "stream": True,
                                             "ignore_eos": True}),
              "lightllm": ("/generate_stream", {"inputs": "long", "parameters": {"max_new_tokens": 480,
                                                                                 "ignore_eos": True}})}

    def stream(dialect: str) -> None:
        path, body = bodies[dialect]
        with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines[dialect].append(line)
                    if len(lines[dialect]) == 1:
                        started.wait(timeout=60)

    readers = [threading.Thread(target=stream, args=(d,)) for d in lines]
    for t in readers:
        t.start()
    started.wait(timeout=60)
    os.kill(worker, signal.SIGSTOP)  # neither stream can finish on its own now
    os.kill(router, signal.SIGKILL)
    for t in readers:
        t.join(timeout=60)
        assert not t.is_alive()
    openai_lines, lightllm_lines = lines["openai"], lines["lightllm"]
    assert openai_lines[-1] == "data: [DONE]", openai_lines[-3:]
    error = json.loads(openai_lines[-2][len("data:"):])["error"]
    assert error["code"] == "shutdown" and error["type"] == "service_unavailable", error
    assert json.loads(lightllm_lines[-1][len("data:"):])["error"]["code"] == "shutdown", lightllm_lines[-3:]
    assert server.proc.wait(timeout=60) == 1
    assert "router.0" in server.output()
    assert not [p for p in children if alive(p)], "orphaned graph processes"
    server.stop()

def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path_factory, tiny_dirs):
    server = start_server(tmp_path_factory, "drain", overrides(tiny_dirs)).wait_healthy()
    children = server.children()
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    results: dict[int, tuple[str, str]] = {}
    started = threading.Barrier(9)

    def stream(i):
        s = client.completions.create(model=MODEL, prompt=f"stream {i}", max_tokens=300, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        text, finish, first = [], None, True
        for ch in s:
            if first:
                started.wait()
                first = False
            text.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        results[i] = ("".join(text), finish)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    for t in threads:
        t.join(timeout=60)
    assert refused.status_code == 503
    assert server.proc.wait(timeout=60) == 0
    assert sorted(results) == list(range(8))
    assert all(finish == "length" for _, finish in results.values())
    assert not [p for p in children if alive(p)]
    assert port_is_free(server.port)
    ipc_dir = load_run_config(str(Path(server.run_dir) / "config.yaml")).graph.ipc_dir
    assert not Path(ipc_dir).exists(), "IPC files left behind"


def test_client_disconnect_aborts_and_frees_kv(tmp_path_factory, tiny_dirs):
    with start_server(tmp_path_factory, "disconnect", overrides(tiny_dirs)) as server:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "go on", "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    break
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and aborted(server) < 1:
            time.sleep(0.2)
        assert aborted(server) == 1, "the disconnected stream was not aborted"
        wait_idle(server)


def aborted(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llaunch:request_success_total{") and 'finished_reason="abort"' in line)
