"""Supervision of the real process graph: a dead worker takes everything down, SIGTERM drains,
a client that goes away frees its KV."""
from __future__ import annotations

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
