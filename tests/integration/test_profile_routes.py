"""POST /start_profile and /stop_profile on a real CPU server (tiny random Qwen2, server.profile_dir): the
worker's torch.profiler covers the steps served between them, and writes a Chrome trace whose events are the
model's ops and a table of them; a start with num_steps ends by itself; what cannot work is a 400 naming it."""
from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from integration.conftest import start_server
from llaunch.runtime.http.profile_routes import profile_message
from llaunch.runtime.web.errors import ApiError

MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny_dirs):
    profiles = tmp_path_factory.mktemp("profiles")
    with start_server(tmp_path_factory, "profiled", ["model=qwen2", f"model.path={tiny_dirs['qwen2']}",
                                                      f"model.name={MODEL}", f"server.profile_dir={profiles}"]) as s:
        yield s, profiles


def complete(server, max_tokens: int) -> str:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.completions.create(model=MODEL, prompt="Profile me:", max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def written(directory: Path, name: str, timeout: float = 60.0) -> tuple[dict, str]:
    """The profile's trace (parsed) and kernel table, once both files are whole."""
    trace, table = directory / f"{name}.trace.json.gz", directory / f"{name}.kernels.txt"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trace.exists() and table.exists():  # the table is written after the trace
            return json.loads(gzip.decompress(trace.read_bytes())), table.read_text()
        time.sleep(0.2)
    raise AssertionError(f"no {name} profile in {directory}: {sorted(p.name for p in directory.iterdir())}")


def op_names(trace: dict) -> set[str]:
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_a_profile_between_start_and_stop_holds_the_served_steps(profiled):
    server, profiles = profiled
    r = httpx.post(server.url + "/start_profile")  # vLLM's: no body
    assert r.status_code == 200, r.text
    assert r.json()["profile_dir"] == str(profiles)
    assert complete(server, 12)
    assert httpx.post(server.url + "/stop_profile").status_code == 200
    trace, table = written(profiles, "worker-0-0-1")
    names = op_names(trace)
    # the model's forward ran inside the profile: its linear layers and its attention's ops
    assert "aten::linear" in names or "aten::mm" in names or "aten::addmm" in names, sorted(names)[:40]
    assert "aten::linear" in table or "aten::mm" in table or "aten::addmm" in table
    assert "Self CPU" in table  # torch.profiler's table, sorted by the CPU's own time on a CPU worker
    # a stop with no profile running changes nothing; the server serves as before
    assert httpx.post(server.url + "/stop_profile").status_code == 200
    assert complete(server, 4)
    assert not (profiles / "worker-0-0-2.trace.json.gz").exists()


def test_a_profile_of_num_steps_ends_by_itself(profiled):
    server, profiles = profiled
    r = httpx.post(server.url + "/start_profile", json={"num_steps": 3, "activities": ["CPU"], "record_shapes": True})
    assert r.status_code == 200, r.text
    assert complete(server, 10)  # a prefill and 9 decode steps: the profile ends after the third
    trace, _ = written(profiles, "worker-0-0-2")
    # record_shapes: the ops carry their inputs' shapes
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])
    assert httpx.post(server.url + "/stop_profile").status_code == 200  # none running any more: nothing written
    assert complete(server, 4)
    time.sleep(1.0)
    assert not (profiles / "worker-0-0-3.trace.json.gz").exists()


@pytest.mark.parametrize("body, field", [
    ({"output_dir": "/tmp/elsewhere"}, "output_dir"),
    ({"num_steps": 0}, "num_steps"),
    ({"activities": ["MEM"]}, "activities"),
    ({"with_stack": "yes"}, "with_stack"),
    ({"profile_by_stage": True}, "profile_by_stage"),
    ({"steps": 3}, "steps"),
])
def test_what_cannot_work_is_a_400_naming_the_field(profiled, body, field):
    server, _ = profiled
    r = httpx.post(server.url + "/start_profile", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_without_a_profile_dir_the_routes_say_how_to_turn_them_on():
    for start in (True, False):
        with pytest.raises(ApiError) as e:
            profile_message(b"", start, None)
        assert e.value.status == 400 and "server.profile_dir" in e.value.message
    with pytest.raises(ApiError) as e:
        profile_message(b'{"num_steps": 2}', False, "/tmp/p")
    assert e.value.status == 400 and "stop_profile takes no fields" in e.value.message
    with pytest.raises(ApiError):
        profile_message(b"[1, 2]", True, "/tmp/p")
    msg = profile_message(b'{"num_steps": 4, "activities": ["GPU", "CPU", "GPU"]}', True, "/tmp/p")
    assert (msg.start, msg.num_steps, msg.activities) == (True, 4, ["GPU", "CPU"])
