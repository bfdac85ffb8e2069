"""The process graph: exact processes, GPUs and wiring for each layout and mode; the port allocator;
the run config as the children read it back."""
from __future__ import annotations

import dataclasses
import itertools
import socket
from pathlib import Path

import pytest

from llaunch.launcher import derive, memory_plan, plan, rules, store
from llaunch.launcher.main import run_config_of, write_run_config
from llaunch.launcher.ports import LOCK_DIR, EndpointAllocator, _lock_port, _unlock_port
from llaunch.runtime.bootstrap import find_spec, load_run_config
from llaunch.runtime.encoder_servers import EncoderServers, encoder_servers


@pytest.fixture
def planned(compose_config):
    """`planned(*overrides) -> (cfg, graph)`: tiny-llama (4 heads, 1 KV head), port 8123, planned."""
    allocators = []

    def run(*overrides: str):
        cfg = derive.resolve(compose_config("model=tiny-llama", "server.port=8123", *overrides))
        endpoints = plan.endpoints_for(cfg)
        allocators.append(endpoints)
        return cfg, plan.plan_graph(cfg, endpoints)

    yield run
    for endpoints in allocators:
        endpoints.close()


def names(graph):
    return [p.name for p in graph.processes]


def check_wiring(graph):
    """Every dialled address is bound by exactly one process of the graph (or is external)."""
    assert len(set(names(graph))) == len(graph.processes)
    binds = [addr for p in graph.processes for addr in p.binds.values()]
    assert len(binds) == len(set(binds)), "two processes bind one address"
    assert plan.unmatched_connects(graph) == []
    for p in graph.processes:
        assert p.connects["control"] == graph.control or graph.control.startswith("tcp://")


def test_normal_on_cpu(planned):
    cfg, g = planned("device=cpu")
    assert names(g) == ["frontend.0", "router.0", "detokenizer", "worker.0.0"]
    assert all(p.gpus == [] for p in g.processes)
    check_wiring(g)
    spec = {p.name: p for p in g.processes}
    assert spec["worker.0.0"].connects["results"] == spec["router.0"].binds["results"]
    assert spec["router.0"].connects["plan.0"] == spec["worker.0.0"].binds["plan"]
    assert spec["router.0"].connects["tokens"] == spec["detokenizer"].binds["tokens"]
    assert spec["detokenizer"].connects["text.0"] == spec["frontend.0"].binds["text"]
    assert spec["frontend.0"].connects["requests.0"] == spec["router.0"].binds["requests"]
    assert g.http_url == "http://127.0.0.1:8123"
    assert all(a.startswith(f"ipc://{g.ipc_dir}/") for p in g.processes for a in p.binds.values())
    assert Path(g.ipc_dir).is_dir() and len(max((a for p in g.processes for a in p.binds.values()), key=len)) < 107
    assert spec["worker.0.0"].connects["dist"] == g.dist_init[0] and g.dist_init[0].startswith("tcp://127.0.0.1:")


def test_tp2_on_cuda(planned):
    _, g = planned("device=cuda", "parallel=tp2")
    assert names(g) == ["frontend.0", "router.0", "detokenizer", "worker.0.0", "worker.0.1"]
    spec = {p.name: p for p in g.processes}
    assert [spec["worker.0.0"].gpus, spec["worker.0.1"].gpus] == [[0], [1]]
    assert [spec[f"worker.0.{r}"].tp_rank for r in (0, 1)] == [0, 1]
    assert {spec[f"worker.0.{r}"].connects["dist"] for r in (0, 1)} == {g.dist_init[0]}  # one rendezvous
    assert spec["router.0"].connects["plan.1"] == spec["worker.0.1"].binds["plan"]
    assert spec["router.0"].gpus == [] and spec["frontend.0"].gpus == []
    check_wiring(g)


def test_dp2_times_tp2_with_three_frontends(planned):
    _, g = planned("device=cuda", "parallel=dp2", "parallel.tp=2", "server.http_workers=3")
    assert names(g) == ["frontend.0", "frontend.1", "frontend.2", "router.0", "router.1", "detokenizer",
                        "worker.0.0", "worker.0.1", "worker.1.0", "worker.1.1"]
    spec = {p.name: p for p in g.processes}
    assert [spec[f"worker.{d}.{r}"].gpus for d in (0, 1) for r in (0, 1)] == [[0], [1], [2], [3]]
    for d in (0, 1):
        assert spec[f"router.{d}"].dp_rank == d
        for r in (0, 1):
            w = spec[f"worker.{d}.{r}"]
            assert (w.dp_rank, w.tp_rank) == (d, r)
            assert w.connects["results"] == spec[f"router.{d}"].binds["results"]
            assert w.connects["dist"] == g.dist_init[d]
    assert len(set(g.dist_init)) == 2  # each replica has its own process group
    for i in range(3):
        assert spec[f"frontend.{i}"].index == i
        assert spec[f"frontend.{i}"].connects["requests.1"] == spec["router.1"].binds["requests"]
        assert spec["detokenizer"].connects[f"text.{i}"] == spec[f"frontend.{i}"].binds["text"]
    check_wiring(g)


@pytest.mark.parametrize("mode", ["pd_prefill", "pd_decode"])
def test_pd_instances_register_and_the_decode_one_receives_kv(planned, mode):
    _, g = planned("device=cpu", f"mode={mode}", "parallel=tp2", "mode.kv_transfer_port=31000")
    assert names(g) == ["frontend.0", "router.0", "detokenizer", "worker.0.0", "worker.0.1"]
    spec = {p.name: p for p in g.processes}
    assert spec["frontend.0"].connects["pd_master"] == "http://127.0.0.1:60011"
    if mode == "pd_decode":  # each rank receives its KV heads; the frontend advertises where, in rank order
        assert [spec[f"worker.0.{r}"].binds["kv_transfer"] for r in (0, 1)] == ["tcp://127.0.0.1:31000",
                                                                              "tcp://127.0.0.1:31001"]
        assert spec["frontend.0"].connects["kv_transfer"] == "tcp://127.0.0.1:31000,tcp://127.0.0.1:31001"
    else:
        assert "kv_transfer" not in spec["worker.0.0"].binds and "kv_transfer" not in spec["frontend.0"].connects
    check_wiring(g)
    if mode == "pd_prefill":
        return
    _, g = planned("device=cpu", f"mode={mode}")  # kv port allocated
    assert g.processes[-1].binds["kv_transfer"].startswith("tcp://127.0.0.1:")


def test_pd_master(planned):
    _, g = planned("mode=pd_master", "server.http_workers=2", "mode.config_server_host=10.0.0.9",
                   "mode.pd_master_port=18001")
    assert names(g) == ["pd_master"]  # it relays to the instances' frontends: none of its own
    master = g.processes[0]
    assert master.role == "pd_master"
    assert master.binds == {"http": "http://127.0.0.1:8123", "register": "http://127.0.0.1:18001"}
    assert g.http_url == master.binds["http"]
    assert master.connects["config_server"] == "http://10.0.0.9:60088"
    check_wiring(g)
    _, g = planned("mode=pd_master", "mode.pd_master_host=::1")
    assert g.processes[0].binds["register"] == "http://[::1]:60011" and "config_server" not in g.processes[0].connects


def test_config_server(planned):
    _, g = planned("mode=config_server", "mode.config_server_port=18088")
    assert names(g) == ["config_server"]
    assert g.processes[0].binds == {"http": "http://127.0.0.1:18088"}
    assert g.http_url == "http://127.0.0.1:18088"  # where masters and instances reach it
    check_wiring(g)


def test_two_nodes_plan_the_same_tcp_graph(planned):
    common = ("device=cuda", "parallel=tp8", "parallel.nnodes=2", "parallel.master_port=29500",
              "parallel.node_addrs=[10.0.0.1,10.0.0.2]", "parallel.master_addr=10.0.0.1")
    _, g0 = planned(*common)
    _, g1 = planned(*common, "parallel.node_rank=1")
    assert g0.processes == g1.processes and g0.control != g1.control  # each node's launcher has its own
    spec = {p.name: p for p in g0.processes}
    assert [spec[f"worker.0.{r}"].node for r in range(8)] == [0] * 4 + [1] * 4
    assert [spec[f"worker.0.{r}"].gpus for r in range(8)] == [[0], [1], [2], [3]] * 2
    assert spec["worker.0.5"].binds["plan"].startswith("tcp://10.0.0.2:")
    assert spec["worker.0.5"].connects["control"] == g1.control
    assert spec["worker.0.5"].connects["results"] == spec["router.0"].binds["results"]
    assert spec["router.0"].binds["results"].startswith("tcp://10.0.0.1:")  # dialled from node 1
    assert g0.dist_init == ["tcp://10.0.0.1:29500"] and g0.ipc_dir == ""
    ports = [int(a.rsplit(":", 1)[1]) for p in g0.processes for a in p.binds.values()]
    assert min(ports) > 29500  # after the rendezvous port, counted from it on every node
    assert [p.name for p in plan.processes_on(g1, 1)] == [f"worker.0.{r}" for r in range(4, 8)]
    check_wiring(g0)


def test_server_port_zero_is_chosen_before_planning(compose_config):
    cfg = derive.resolve(compose_config("model=tiny-llama", "server.port=0", "device=cpu"))
    with EndpointAllocator() as endpoints:
        with pytest.raises(ValueError, match="server.port=0"):
            plan.plan_graph(cfg, endpoints)
        chosen = plan.choose_server_port(cfg, endpoints)
        assert chosen.server.port > 0
        assert plan.plan_graph(chosen, endpoints).http_url == f"http://127.0.0.1:{chosen.server.port}"


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_ports_are_reserved_until_handed_over_and_locked_until_closed():
    a, b = EndpointAllocator(), EndpointAllocator()
    ports_a = {a.free_port() for _ in range(10)}
    ports_b = {b.free_port() for _ in range(10)}
    assert len(ports_a) == len(ports_b) == 10 and not ports_a & ports_b
    port = next(iter(ports_a))
    assert not bindable(port)  # the probe socket holds it
    a.handover()
    assert bindable(port)  # now a child can bind it...
    assert _lock_port(port) is None  # ...and no other llaunch will pick it meanwhile
    a.close()
    assert not (LOCK_DIR / f"{port}.lock").exists()  # released and cleaned up
    fd = _lock_port(port)
    assert fd is not None
    _unlock_port(port, fd)
    b.close()


def test_ipc_dir_is_private_and_removed():
    a, b = EndpointAllocator(), EndpointAllocator()
    assert a.endpoint("x") != b.endpoint("x")
    d = Path(a.ipc_dir)
    assert d.is_dir() and d.name.startswith("llaunch-")
    a.close()
    b.close()
    assert not d.exists()
    tcp = EndpointAllocator(tcp_base_port=40000)
    assert [tcp.endpoint("x", "h"), tcp.endpoint("y", "h")] == ["tcp://h:40000", "tcp://h:40001"]


def test_children_read_back_the_run_config(planned, tmp_path):
    cfg, g = planned("device=cpu", "parallel=dp2", "bench=c64")
    path = write_run_config(run_config_of(cfg, tmp_path / "run", g))
    back = load_run_config(str(path))  # runtime/bootstrap.py: what every child does first
    assert back == run_config_of(cfg, tmp_path / "run", g)
    assert back.bench.request_rate == float("inf")
    assert find_spec(back, "worker.1.0").connects["dist"] == g.dist_init[1]
    cfg, g = planned("device=cpu", "mode=pd_decode")
    assert load_run_config(str(write_run_config(run_config_of(cfg, tmp_path / "pd", g)))).router.max_wait_tokens == 0


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_every_profile_combination_plans_or_names_its_conflict(compose_config):
    """A dry run for another machine: any model x parallel x mode either plans a well-wired graph or
    fails only because the heads do not split over tp (e.g. SmolLM2's 9 heads over tp2)."""
    options = {g: {p: getattr(compose_config(f"{g}={p}"), g) for p in store.profiles(g)}
               for g in ("model", "parallel", "mode")}
    base = compose_config("device=cuda", "dry_run=true")
    planned = 0
    for (mname, model), (pname, par), (_, mode) in itertools.product(*(o.items() for o in options.values())):
        cfg = derive.resolve(dataclasses.replace(base, model=model, parallel=par, mode=mode))
        violations = rules.check_all(cfg)
        pd_instance = mode.kind.value in ("pd_prefill", "pd_decode")
        if pd_instance and (par.dp, par.nnodes) != (1, 1):  # one replica per pd instance
            assert "pd_instance_is_one_replica" in {v.rule for v in violations}
            continue
        if (cfg.model.vision or cfg.model.audio) and (pd_instance or par.nnodes > 1):  # media: one-node normal instances only
            assert "visual_deployment_supported" in {v.rule for v in violations}
            continue
        if violations:
            assert {v.rule for v in violations} == {"tp_splits_heads"}, (mname, pname, violations)
            assert cfg.parallel.tp > 1 and (cfg.model.num_attention_heads % cfg.parallel.tp
                                            or cfg.model.num_key_value_heads % cfg.parallel.tp
                                            and cfg.parallel.tp % cfg.model.num_key_value_heads)
            continue
        with plan.endpoints_for(cfg) as endpoints:
            graph = plan.plan_graph(cfg, endpoints)
        check_wiring(graph)
        workers = [p for p in graph.processes if p.role == "worker"]
        if cfg.mode.kind.value in ("normal", "pd_prefill", "pd_decode"):
            assert sorted(g for w in workers for g in w.gpus) == list(range(par.tp * par.dp))
        else:
            assert workers == []
        planned += 1
    assert planned > 100


def test_host_kv_tier_adds_one_pool_owner_per_node(planned):
    _, g = planned("device=cuda", "parallel=dp2", "parallel.tp=2", "cache.cpu_tokens=1000")
    assert names(g)[0] == "kv_host.0"  # started first: the workers map its files
    spec = {p.name: p for p in g.processes}
    pools = spec["kv_host.0"].binds
    assert sorted(pools) == ["pool.0.0", "pool.0.1", "pool.1.0", "pool.1.1"]
    for d in (0, 1):
        for r in (0, 1):
            assert spec[f"worker.{d}.{r}"].connects["kv_host"] == pools[f"pool.{d}.{r}"]
    assert len(set(pools.values())) == 4
    check_wiring(g)
    _, other = planned("device=cuda", "parallel=dp2", "parallel.tp=2", "cache.cpu_tokens=1000")
    assert not set(pools.values()) & set(p for s in other.processes for p in s.binds.values())  # per instance


def test_dp_fetch_maps_every_replica_index_and_the_peer_pools_of_each_rank(planned):
    _, g = planned("device=cuda", "parallel=dp2", "parallel.tp=2", "cache.cpu_tokens=1000", "cache.dp_fetch=true")
    spec = {p.name: p for p in g.processes}
    binds = spec["kv_host.0"].binds
    assert sorted(k for k in binds if k.startswith("index.")) == ["index.0", "index.1"]
    for d in (0, 1):
        assert {k: v for k, v in spec[f"router.{d}"].connects.items() if k.startswith("kv_index.")} == {
            "kv_index.0": binds["index.0"], "kv_index.1": binds["index.1"]}
        for r in (0, 1):  # rank r reads rank r's pool of the other replica
            assert spec[f"worker.{d}.{r}"].connects[f"kv_peer.{1 - d}"] == binds[f"pool.{1 - d}.{r}"]
    check_wiring(g)


def test_a_multimodal_model_adds_its_visual_servers(planned):
    _, g = planned("model=qwen2-vl-7b", "model.load_format=dummy", "device=cuda", "dry_run=true", "parallel=dp2",
                   "visual.dp=2", "visual.devices=[1,0]")
    spec = {p.name: p for p in g.processes}
    assert [spec["visual.0"].gpus, spec["visual.1"].gpus] == [[1], [0]]
    for v in (0, 1):
        server = spec[f"visual.{v}"]
        assert server.connects["ready.0"] == spec["router.0"].binds["results"]  # it answers every router
        assert server.connects["ready.1"] == spec["router.1"].binds["results"]
        for name in ("router.0", "router.1"):
            assert spec[name].connects[f"visual.{v}"] == server.binds["encode"]
        for name in ("worker.0.0", "worker.1.0"):
            assert spec[name].connects[f"embeds.{v}"] == server.binds["embeds"]  # the embed cache's file
    check_wiring(g)
    _, text = planned("device=cuda", "dry_run=true")
    assert not [p for p in text.processes if p.role == "visual"]  # a text model has none


def test_an_audio_model_plans_audio_dp_servers_on_audio_devices(planned):
    cfg, g = planned("model=qwen2-audio-7b", "model.load_format=dummy", "device=cuda", "dry_run=true", "parallel=dp2",
                     "audio.dp=2", "audio.devices=[1,0]", "audio.batch_size=4", "audio.embed_cache_mib=64")
    spec = {p.name: p for p in g.processes}
    assert [p.name for p in g.processes if p.role == "visual"] == ["audio.0", "audio.1"]  # the visual.* keys unused
    assert [spec["audio.0"].gpus, spec["audio.1"].gpus] == [[1], [0]]
    for a in (0, 1):
        server = spec[f"audio.{a}"]
        for name in ("router.0", "router.1"):  # routers and workers dial them as any encoder server
            assert spec[name].connects[f"visual.{a}"] == server.binds["encode"]
        for name in ("worker.0.0", "worker.1.0"):
            assert spec[name].connects[f"embeds.{a}"] == server.binds["embeds"]
    check_wiring(g)
    assert encoder_servers(cfg) == EncoderServers("audio", 2, 1, 4, (1, 0), 64)  # what the servers and workers read
    assert "embed cache 64 MiB x 2 audio server(s)" in memory_plan.summary(cfg)  # the dry run's memory line


def test_visual_tp_adds_followers_on_their_own_gpus_sharing_a_rendezvous(planned):
    _, g = planned("model=qwen2-vl-7b", "model.load_format=dummy", "device=cuda", "dry_run=true", "parallel=dp2",
                   "visual.dp=2", "visual.tp=2", "visual.devices=[3,2,1,0]")
    spec = {p.name: p for p in g.processes}
    visual = [p.name for p in g.processes if p.role == "visual"]
    assert visual == ["visual.0", "visual.0.1", "visual.1", "visual.1.1"]
    assert [spec[n].gpus for n in visual] == [[3], [2], [1], [0]]
    for v in (0, 1):
        leader, follower = spec[f"visual.{v}"], spec[f"visual.{v}.1"]
        assert (leader.tp_rank, follower.tp_rank, follower.index) == (0, 1, v)
        assert leader.connects["dist"] == follower.connects["dist"]  # one process group per visual server
        assert not follower.binds  # only the leader serves routers and owns the embed cache
        assert spec["router.0"].connects[f"visual.{v}"] == leader.binds["encode"]
    assert spec["visual.0"].connects["dist"] != spec["visual.1"].connects["dist"]
    check_wiring(g)
