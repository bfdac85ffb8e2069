"""Tensor and data parallelism through real `llaunch` process graphs on CPU (gloo, float32):

- tp2 greedy output equals tp1 and transformers token for token (Qwen2 with its 2 KV heads split,
  Llama with 1 KV head replicated on both ranks), and so does tp4 (Qwen2's 2 KV heads replicated);
- heads that do not split (9 query, 3 KV, as SmolLM2) are padded with zero heads under tp2 and tp4;
- dp2 serves 16 concurrent requests with the right output, both replicas running some of them;
- two "nodes" (two llaunch processes on loopback: one tp rank each, or one dp replica each) serve
  requests from node 0; SIGTERM on node 0 drains its in-flight request, then node 1 stops too.
"""
from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from integration.conftest import CPU_BASE, start_server
from integration.server import REPO, LlaunchServer, free_port, metric_samples, port_is_free
from integration.test_supervision import alive
from llaunch.launcher import supervise
from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, TextBatch, TextDelta

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1, 2, 3, 4,"]
MAX_NEW = 12
GREEDY = {"ignore_eos": True, "return_token_ids": True}  # the oracle continues past eos too


def model_overrides(family: str, tiny_dirs) -> list[str]:
    return [f"model={family}", f"model.path={tiny_dirs[family]}", f"model.name=tiny-{family}"]


def greedy_ids(server, family: str, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = api.completions.create(model=f"tiny-{family}", prompt=prompt, max_tokens=max_new, temperature=0,
                                 extra_body=GREEDY)
    return out.choices[0].model_extra["token_ids"]


def start_all(servers: list[LlaunchServer]) -> list[LlaunchServer]:
    """The servers were spawned together (start-up overlaps); wait for each, stop all on failure."""
    try:
        return [s.wait_healthy() for s in servers]
    except Exception:
        stop_all(servers)
        raise


def stop_all(servers: list[LlaunchServer]) -> None:
    """SIGINT every launcher first, so their teardowns overlap; each gets one signal only."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGINT)
    for s in servers:
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        s.stop()  # closes the log (and kills one that did not stop)


# ---- tensor parallelism -----------------------------------------------------------------------


TP_SIZES = {"qwen2": (1, 2, 4), "llama": (1, 2)}  # 4 heads; KV heads: qwen2 2, llama 1


@pytest.fixture(scope="module", params=sorted(TP_SIZES))
def tp_servers(request, tmp_path_factory, tiny_dirs):
    family = request.param
    servers = start_all([start_server(tmp_path_factory, f"{family}-tp{tp}",
                                      model_overrides(family, tiny_dirs) + [f"parallel=tp{tp}"])
                         for tp in TP_SIZES[family]])
    yield family, dict(zip(TP_SIZES[family], servers))
    stop_all(servers)


def test_tp_greedy_equals_tp1_and_transformers(tp_servers, oracles):
    family, servers = tp_servers
    oracle = oracles(family)
    for prompt in PROMPTS:
        want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW)
        for tp, server in servers.items():
            assert greedy_ids(server, family, prompt) == want, f"tp{tp}, prompt {prompt!r}"
    for tp, server in servers.items():  # one process per rank
        workers = sorted(p.name for p in (server.run_dir / "logs").glob("worker.*.log"))
        assert workers == [f"worker.0.{r}.log" for r in range(tp)]


# SmolLM2's head counts (9 query, 3 KV): tp2 pads one KV head and three query heads, tp4 a whole rank
PADDED = dict(num_attention_heads=9, num_key_value_heads=3, head_dim=16, hidden_size=144)


@pytest.fixture(scope="module")
def padded_llama(tmp_path_factory):
    from fixtures.tiny_models import write_tiny_checkpoint
    from integration.conftest import HfOracle

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-9h"), "llama", seed=3, **PADDED)
    return folder, HfOracle(folder)


@pytest.mark.parametrize("tp", [2, 4])
def test_padded_heads_tp_equals_transformers(tp, tmp_path_factory, padded_llama):
    folder, oracle = padded_llama
    overrides = ["model=llama", f"model.path={folder}", "model.name=tiny-llama", f"parallel=tp{tp}",
                 "parallel.pad_heads=true"]
    with start_server(tmp_path_factory, f"llama-9h-tp{tp}", overrides) as server:
        for prompt in PROMPTS:
            want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW)
            assert greedy_ids(server, "llama", prompt) == want, f"tp{tp}, prompt {prompt!r}"


# ---- data parallelism -------------------------------------------------------------------------


def admitted_requests(run_dir: Path, replica: int) -> list[str]:
    """Request ids a replica's rank 0 logged as started (runtime/worker/process.py log_admitted)."""
    text = (run_dir / "logs" / f"worker.{replica}.0.log").read_text()
    return [rid for line in re.findall(r"new request\(s\): (.*)$", text, re.M) for rid in line.split()]


def test_dp2_serves_16_concurrent_requests_on_both_replicas(tmp_path_factory, tiny_dirs, oracles):
    oracle = oracles("qwen2")
    prompts = [f"Request {i}: " + "count with me " * (1 + i % 5) for i in range(16)]
    with start_server(tmp_path_factory, "qwen2-dp2", model_overrides("qwen2", tiny_dirs) + ["parallel=dp2"]) as server:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def one(prompt):
            out = await client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=16, temperature=0,
                                                  extra_body=GREEDY)
            return out.choices[0].model_extra["token_ids"]

        async def all_at_once():
            return await asyncio.gather(*(one(p) for p in prompts))

        got = asyncio.run(all_at_once())
        for prompt, ids in zip(prompts, got):
            assert ids == oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 16), f"prompt {prompt!r}"
        per_replica = [admitted_requests(server.run_dir, d) for d in (0, 1)]
        assert sorted(per_replica[0] + per_replica[1]) == sorted(f"0-{i}" for i in range(16))
        assert len(per_replica[0]) >= 2 and len(per_replica[1]) >= 2, f"unbalanced: {per_replica}"
        running = metric_samples(server.url, "num_requests_running")
        for d in (0, 1):  # each replica reports its own scheduler gauges
            assert (("dp_rank", str(d)), ("model_name", "tiny-qwen2")) in running, running


def test_requests_go_to_the_replica_with_fewest_outstanding_tokens():
    posted: list[tuple[int, AddRequest]] = []

    async def post(replica, msg):
        posted.append((replica, msg))

    async def scenario():
        client = EngineClient(0, 2, post)
        long = await client.submit([([1] * 100, SamplingParams(max_new_tokens=100))])  # 200 tokens on 0
        short = [await client.submit([([1] * 10, SamplingParams(max_new_tokens=10))]) for _ in range(3)]
        load = list(client.outstanding_tokens)
        await long.abort()
        after_abort = await client.submit([([1] * 10, SamplingParams(max_new_tokens=10))])
        return [g.replica for g in (long, *short, after_abort)], load, list(client.outstanding_tokens)

    replicas, load, after = asyncio.run(scenario())
    # three short requests (20 tokens each) still weigh less than the long one: all go to replica 1
    assert replicas == [0, 1, 1, 1, 0] and load == [200, 60] and after == [20, 60]
    assert [replica for replica, msg in posted if isinstance(msg, AddRequest)] == [0, 1, 1, 1, 0]


def test_prefill_balance_spreads_prompts_still_to_prefill():
    """router.dp_prefill_balance: a request goes where the fewest prompt tokens wait to be prefilled,
    even where the outstanding load is higher; a request's prompt stops counting at its first token."""

    async def placements(balance: bool) -> list[int]:
        async def post(replica, msg):
            pass

        client = EngineClient(0, 2, post, prefill_balance=balance)
        a = await client.submit([([1] * 100, SamplingParams(max_new_tokens=10))])
        b = await client.submit([([1] * 10, SamplingParams(max_new_tokens=500))])
        c = await client.submit([([1] * 100, SamplingParams(max_new_tokens=10))])
        # a's and c's first tokens: nothing waits for prefill on either replica any more
        for group in (a, c):
            await client.on_message(TextBatch(deltas=[TextDelta(request_id=group.request_ids[0], text="x",
                                                                token_ids=[5])]))
        d = await client.submit([([1] * 100, SamplingParams(max_new_tokens=10))])
        return [g.replica for g in (a, b, c, d)], list(client.pending_prefill)

    # by load alone c joins a's replica (110 tokens < 510) and so does d (220 < 510)
    by_load, pending = asyncio.run(placements(False))
    assert by_load == [0, 1, 0, 0] and pending == [100, 10]
    # balanced: c goes where 10 prompt tokens wait, not 100; after the first tokens only b's 10 wait, on 1
    balanced, pending = asyncio.run(placements(True))
    assert balanced == [0, 1, 1, 0] and pending == [100, 10]


# ---- two nodes on one machine -----------------------------------------------------------------


def free_port_range(n: int) -> int:
    """A base port with `n` consecutive free ports, below the usual ephemeral range (so a port the
    OS hands out meanwhile does not land in it): the nodes number their endpoints from it."""
    for _ in range(100):
        base = random.randrange(20000, 30000 - n)
        if all(port_is_free(p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free port range")


def launcher_children(pid: int) -> list[tuple[int, str, str]]:
    """(pid, module, process name) of the graph processes a launcher started."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                args = cmdline.decode().split("\0")  # python -m MODULE --config PATH --name NAME
                out.append((int(entry.name), args[2], args[args.index("--name") + 1]))
    return out


# Node 1's share of the graph per layout: a tp rank of the one replica (its node-0 peer and the
# router go away together), or a whole dp replica (only its router, on node 0, goes away).
NODE1_WORKER = {"tp2": "worker.0.1", "dp2": "worker.1.0"}


def start_two_nodes(layout: str, tmp_path_factory, tiny_dirs, extra: tuple[str, ...] = ()):
    """(node 0 as a LlaunchServer, node 1's launcher process, its log path, its log file, its port)."""
    master_port = free_port_range(16)
    common = CPU_BASE + model_overrides("qwen2", tiny_dirs) + [
        f"parallel={layout}", "parallel.nnodes=2", "parallel.master_addr=127.0.0.1",
        f"parallel.master_port={master_port}", "parallel.node_addrs=[127.0.0.1,127.0.0.1]", *extra]
    # node 1 gets its own server.port only because both "nodes" share this host: it must not bind it
    node1_port = free_port()
    node1_dir = tmp_path_factory.mktemp(f"run-{layout}-node1")
    node1_log_path = node1_dir.parent / f"{node1_dir.name}-launcher.log"
    node1_log = open(node1_log_path, "wb")
    node1 = subprocess.Popen([sys.executable, "-m", "llaunch.launcher.main", *common, "parallel.node_rank=1",
                              f"server.port={node1_port}", f"hydra.run.dir={node1_dir}"],
                             cwd=REPO, stdout=node1_log, stderr=subprocess.STDOUT)
    node0 = LlaunchServer(common + ["parallel.node_rank=0"], run_dir=tmp_path_factory.mktemp(f"run-{layout}-node0"))
    return node0, node1, node1_dir, node1_log_path, node1_log, node1_port


@pytest.mark.parametrize("layout", sorted(NODE1_WORKER))
def test_two_nodes_serve_and_stop_together_on_sigterm(layout, tmp_path_factory, tiny_dirs, oracles):
    node0, node1, node1_dir, node1_log_path, node1_log, node1_port = start_two_nodes(layout, tmp_path_factory,
                                                                                     tiny_dirs)
    try:
        node0.wait_healthy()
        oracle = oracles("qwen2")
        client = AsyncOpenAI(base_url=node0.url + "/v1", api_key="none", max_retries=0)

        async def one(prompt):
            out = await client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=MAX_NEW,
                                                  temperature=0, extra_body=GREEDY)
            return out.choices[0].model_extra["token_ids"]

        async def together():  # with dp2, the second request goes to the replica on node 1
            return await asyncio.gather(*(one(p) for p in PROMPTS[:2]))

        for prompt, ids in zip(PROMPTS, asyncio.run(together())):
            assert ids == oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW), f"prompt {prompt!r}"

        node0_names = sorted(name for _, _, name in launcher_children(node0.proc.pid))
        assert node0_names == sorted(["detokenizer", "frontend.0", "worker.0.0"]
                                     + [f"router.{d}" for d in range(2 if layout == "dp2" else 1)])
        node1_children = launcher_children(node1.pid)
        # node 1 runs workers only: no frontend, router or detokenizer
        assert [(module, name) for _, module, name in node1_children] == [
            ("llaunch.runtime.worker.process", NODE1_WORKER[layout])]
        assert port_is_free(node1_port), "node 1 bound an HTTP port"
        if layout == "dp2":
            assert admitted_requests(node1_dir, replica=1), "the replica on node 1 got no request"

        # SIGTERM drains node 0 (a tp rank on node 1 keeps serving the stream to its end), then node 0
        # exits 0; node 1's worker loses its peer or router and node 1 exits non-zero, naming the cause
        api = OpenAI(base_url=node0.url + "/v1", api_key="none", max_retries=0)
        prompt = PROMPTS[2]
        stream = api.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=48, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        node0.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 48)
        assert "".join(c.choices[0].text for c in chunks) == oracle.tokenizer.decode(want)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert node0.stop() == 0
        t0 = time.monotonic()
        assert node1.wait(timeout=30) == 1
        assert time.monotonic() - t0 < 15
        out = node1_log_path.read_text()
        assert NODE1_WORKER[layout] in out and "went away" in out
        assert not [pid for pid, _, _ in node1_children if alive(pid)], "node 1 left a worker behind"
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.send_signal(signal.SIGINT)
            node1.wait(30)
        node1_log.close()


def test_node_0_notices_a_dead_replica_on_another_node(tmp_path_factory, tiny_dirs, oracles):
    """dp2 over two nodes: node 1 (replica 1) is killed. Node 0's router for replica 1 sees its
    worker's connection drop, reports the replica stalled (metric, /health), fails what ran there,
    and the frontend sends new requests to replica 0 only: none hangs."""
    node0, node1, _, _, node1_log, _ = start_two_nodes("dp2", tmp_path_factory, tiny_dirs)
    try:
        node0.wait_healthy()
        oracle = oracles("qwen2")
        assert greedy_ids(node0, "qwen2", PROMPTS[0]) == oracle.greedy(oracle.tokenizer(PROMPTS[0])["input_ids"], MAX_NEW)
        node1.kill()  # the launcher, and with it (PR_SET_PDEATHSIG) its worker: the node is gone
        node1.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = httpx.get(node0.url + "/health").json()
            if health.get("stalled_replicas") == [1]:
                break
            time.sleep(0.2)
        assert health.get("stalled_replicas") == [1], health
        stalled = metric_samples(node0.url, "engine_stalled")
        assert stalled == {(("dp_rank", "0"), ("model_name", "tiny-qwen2")): 0.0,
                           (("dp_rank", "1"), ("model_name", "tiny-qwen2")): 1.0}, stalled
        for prompt in PROMPTS:  # every one is served, on replica 0
            want = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW)
            assert greedy_ids(node0, "qwen2", prompt) == want
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.kill()
        node1_log.close()


def test_launcher_and_worker_agree_on_the_peer_gone_status():
    from llaunch.runtime.worker.process import EXIT_PEER_GONE

    assert supervise.PEER_GONE_EXIT == EXIT_PEER_GONE
