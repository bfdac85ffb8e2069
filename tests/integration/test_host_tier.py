"""The host KV tier (cache.cpu_tokens) end to end on CPU, tiny random Qwen2 in float32: with a GPU
pool ("GPU" is host memory here; the tier logic is the same) small enough that the prompt cache
evicts through both tiers, greedy outputs are token-identical to a run without any prompt cache;
the moved KV travels through a real pool file the way a worker maps it; every slot of both pools is
accounted for. Then one real server (a kv_host process owning the pool): a conversation's history
evicted to the host tier comes back as a host-tier hit with the tokens of its cold run, the metrics
say so, a multi-turn bench_serving run passes, and the pool file is gone after the server stops."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder
from integration.conftest import start_server
from integration.test_prompt_cache import Engine, metrics, random_ids, wait_for
from llaunch.runtime.cache.host_pool import create_pool
from llaunch.runtime.ipc.messages import SamplingParams
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.host_kv import HostKvPool

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)


class TieredEngine(Engine):
    """Engine with the host tier: its plans' moves are applied to a pool file before each step."""

    def __init__(self, model, kv_slots: int, host_slots: int, pool_file: str, cuda_graphs: bool = False):
        super().__init__(model, True, kv_slots=kv_slots, cuda_graphs=cuda_graphs)
        self.sched = Scheduler(SchedulerLimits(**{**self.sched.limits.__dict__, "host_kv_tokens": host_slots}))
        create_pool(pool_file, host_slots * model.kv_bytes_per_token)
        self.pool = HostKvPool(self.runner.kv, pool_file, host_slots, self.runner.kv.k[0].device, timeout_s=5)
        execute = self.runner.execute

        def with_moves(plan):
            self.pool.apply(plan.kv_moves)
            return execute(plan)

        self.runner.execute = with_moves


def conversations(rng, n: int, turns: int):
    """Per conversation: a 40-token history, then turns that re-send it with the last answer."""
    return [[random_ids(rng, 40)] + [random_ids(rng, 4) for _ in range(turns - 1)] for _ in range(n)]


def test_same_tokens_with_eviction_through_both_tiers_in_process(tiny_dirs, tmp_path):
    model = build_model(model_config_from_folder(tiny_dirs["qwen2"]), device=torch.device("cpu"), dtype=torch.float32)
    same_tokens_with_eviction_through_both_tiers(model, str(tmp_path / "pool"))


def same_tokens_with_eviction_through_both_tiers(model, pool_file: str, cuda_graphs: bool = False) -> "TieredEngine":
    """(tests/gpu runs it with the pool registered with CUDA and decode steps replayed from graphs)"""
    tiered = TieredEngine(model, kv_slots=110, host_slots=220, pool_file=pool_file, cuda_graphs=cuda_graphs)
    big = Engine(model, True, kv_slots=1200, cuda_graphs=cuda_graphs)  # the prompt cache alone: the reference KV
    convs = conversations(random.Random(3), n=6, turns=3)
    history = {i: [] for i in range(len(convs))}
    for turn in range(3):  # each turn's 6 histories (~45-70 tokens each) overflow 110 slots: evict
        jobs = {f"c{i}/{turn}": (history[i] + conv[turn], GREEDY) for i, conv in enumerate(convs)}
        outs = {name: e.run(jobs) for name, e in (("tiered", tiered), ("big", big))}
        assert outs["tiered"] == outs["big"]
        assert_same_kv(tiered, big)  # the greedy tokens of a random tiny model barely depend on the KV: check it
        for i in history:
            history[i] = jobs[f"c{i}/{turn}"][0] + outs["big"][f"c{i}/{turn}"]
    assert big.evicted == 0
    s = tiered.sched
    tree = s.cache.tree
    assert tree.demoted > 0 and tree.promoted > 0 and tree.dropped > 0  # both tiers evicted
    assert s.cache.host_hits > 0
    gpu_held = [x for n in tree.nodes() if not n.on_host for x in n.slots]
    host_held = [x for n in tree.nodes() if n.on_host for x in n.slots]
    assert sorted(gpu_held + s.kv._free) == list(range(110))
    assert sorted(host_held + s.cache.host._free) == list(range(220))
    assert s.cache.locked == 0
    tiered.pool.close()
    return tiered


def path_tokens(node) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def assert_same_kv(tiered: TieredEngine, big: Engine) -> None:
    """Every cached node holds, in whichever tier, the KV the never-evicting cache holds for its tokens."""
    ref_kv, kv, pool = big.runner.kv, tiered.runner.kv, tiered.pool.pool
    for node in list(tiered.sched.cache.tree.nodes()):
        ref_slots = big.sched.cache.tree.match(path_tokens(node))[0][-len(node.slots):]
        assert len(ref_slots) == len(node.slots)
        ref, mine = torch.tensor(ref_slots, device=kv.k[0].device), torch.tensor(node.slots, device=kv.k[0].device)
        for layer in (0, len(kv.k) - 1):
            for side, (ours, theirs) in enumerate(((kv.k[layer], ref_kv.k[layer]), (kv.v[layer], ref_kv.v[layer]))):
                got = pool[side, layer][mine] if node.on_host else ours[mine]
                torch.testing.assert_close(got, theirs[ref], atol=1e-6, rtol=1e-4)


# ---- one real server --------------------------------------------------------------------------

MODEL = "tiny-qwen2"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    with start_server(tmp_path_factory, "host-tier",
                      ["model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}",
                       "cache.max_total_tokens=200", "cache.cpu_tokens=400", "router.max_running_requests=4",
                       "model.max_model_len=192"]) as srv:
        yield srv
    assert not [p for p in os.listdir(SHM) if p.startswith("llaunch-kv-")]  # kv_host removed its pool at exit


def complete(server, prompt: list[int]) -> list[int]:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_host_tier_hit_returns_the_tokens_of_the_cold_run(server):
    rng = random.Random(9)
    first = random_ids(rng, 120)
    cold = complete(server, first)["choices"][0]["text"]
    for _ in range(3):  # other prompts push the first one's KV out of the 200 GPU slots, to the host
        complete(server, random_ids(rng, 120))
    before = metrics(server)
    again = complete(server, first)["choices"][0]["text"]
    assert again == cold
    m = wait_for(server, lambda m: m.get("kv_promoted_tokens_total", 0) > before.get("kv_promoted_tokens_total", 0),
                 "a promotion")
    assert m["prefix_cache_host_hits_total"] > before.get("prefix_cache_host_hits_total", 0)
    assert m["kv_demoted_tokens_total"] > 0 and m["host_kv_cache_usage_perc"] > 0
    assert [p for p in os.listdir(SHM) if p.startswith("llaunch-kv-")]  # the kv_host process's file, mapped by the worker


def test_a_multi_turn_bench_run_reports_both_tiers(server, tmp_path):
    out = tmp_path / "bench.json"
    bench = subprocess.run(
        [sys.executable, "scripts/bench_serving.py", "--base-url", server.url, "--model", MODEL, "--num-prompts", "6",
         "--input-len", "40", "--output-len", "3", "--multi-turn", "3", "--concurrency", "3", "--warmup", "0",
         "--vocab-size", "1000", "--result-file", str(out)], capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 18 and result["failed"] == 0
    assert result["prefix_cache_hits"] > 0 and "host_cache_hits" in result and result["kv_demoted_tokens"] > 0
    assert "host-tier" in bench.stdout


def test_the_graph_goes_down_when_kv_host_dies(server):
    """Last in the module: SIGKILL the pool's owner; llaunch exits non-zero naming it, leaves no
    process behind, and removes the pool files the dead process could not (the fixture checks)."""
    [host_pid] = [pid for pid in server.children()
                  if b"llaunch.runtime.kv_host.process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    graph = server.children()
    os.kill(host_pid, signal.SIGKILL)
    assert server.proc.wait(60) != 0
    assert "kv_host.0" in server.output()
    assert not [pid for pid in graph if running(pid)]


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] != b"Z"
