"""The process graph of a resolved config: which processes run, on which GPUs, and which endpoints each
binds and dials. A pure function of the config and an EndpointAllocator, so it is tested without
starting anything and printed by a dry run.

Endpoint keys are role-local names the runtime looks up:
  worker.{d}.{r}  binds plan;                  connects results, control, dist (torch.distributed init)
  router.{d}      binds requests, results;     connects plan.{r} per tp rank, tokens, control
  detokenizer     binds tokens (and metrics: an http URL, server.metrics_port); connects text.{i} per
                  frontend, control
  frontend.{i}    binds text;                  connects requests.{d} per replica, control
pd_decode adds worker.0.{r} kv_transfer (bound: rank r of a prefill instance sends its KV heads
there); pd frontends dial pd_master (an http URL: frontend.0 registers there), and a decode
instance's name every rank's kv_transfer (comma-separated, rank order);
pd_master runs one process binding http (clients) and register (instances), both http:// URLs;
config_server runs one registry process binding http.
cache.cpu_tokens > 0 adds kv_host.{node}: binds pool.{d}.{r} (a shared-memory file path per worker of
its node, the host KV tier); each worker connects kv_host to its own.
A multimodal model (model.vision, or model.audio) adds visual.{v} (visual.dp of them, on node 0): binds encode (routers
send EncodeImages there; it answers on each router's results, connecting ready.{d}) and embeds (its
embed cache's shared-memory file path); every router connects visual.{v}, every worker embeds.{v}.
visual.tp > 1 adds visual.{v}.{r} (r = 1 .. visual.tp-1), binding nothing: with visual.{v} they dial dist.
An audio model (model.audio) names them audio.{a} (audio.dp, audio.devices; runtime/encoder_servers.py);
routers and workers still connect visual.{a} and embeds.{a}.
"""
from __future__ import annotations

from dataclasses import replace
from llaunch.launcher.ports import EndpointAllocator
from llaunch.runtime.cache.host_pool import index_path, pool_path
from llaunch.runtime.encoder_servers import encoder_servers, multimodal
from llaunch.runtime.cache.embed_shm import embeds_path
from llaunch.runtime.config import Device, KvTransport, LlaunchConfig, Mode, ProcessGraph, ProcessSpec, ZmqMode

# Dialled addresses that no process of this graph binds: the launcher's own control socket,
# torch.distributed's rendezvous (rank 0's TCPStore), and other instances of a pd deployment.
EXTERNAL_KEYS = ("control", "dist", "pd_master", "config_server", "kv_transfer")


def endpoints_for(cfg: LlaunchConfig) -> EndpointAllocator:
    """ipc endpoints on one node (or free tcp ports with parallel.zmq_mode=tcp); with several nodes, tcp
    ports after the rendezvous ports, same on every node."""
    p = cfg.parallel
    if p.nnodes > 1:
        return EndpointAllocator(tcp_base_port=p.master_port + p.dp)
    return EndpointAllocator(local_tcp=p.zmq_mode == ZmqMode.tcp)


def choose_server_port(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> LlaunchConfig:
    """server.port=0 means any free port: choose it now, so the run config and the graph agree."""
    if cfg.server.port != 0:
        return cfg
    return replace(cfg, server=replace(cfg.server, port=endpoints.free_port(cfg.server.host)))


def plan_graph(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> ProcessGraph:
    if cfg.server.port == 0:
        raise ValueError("server.port=0: call choose_server_port before planning")
    kind = cfg.mode.kind
    if kind == Mode.pd_master:
        return _pd_master_graph(cfg, endpoints)
    if kind == Mode.config_server:
        return _config_server_graph(cfg, endpoints)
    return _serving_graph(cfg, endpoints)


def _node_host(cfg: LlaunchConfig, node: int) -> str:
    p = cfg.parallel
    return p.node_addrs[node] if p.nnodes > 1 else "127.0.0.1"


def _controls(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> list[str]:
    """Each node's launcher PULLs readiness reports from the processes it starts."""
    return [endpoints.endpoint("control", _node_host(cfg, n)) for n in range(max(cfg.parallel.nnodes, 1))]


def _http_url(cfg: LlaunchConfig) -> str:
    host = cfg.server.host
    return f"http://[{host}]:{cfg.server.port}" if ":" in host else f"http://{host}:{cfg.server.port}"


def _dist_inits(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> list[str]:
    p = cfg.parallel
    ports = ([p.master_port + d for d in range(p.dp)] if p.master_port is not None
             else [endpoints.free_port("0.0.0.0") for _ in range(p.dp)])  # TCPStore listens on all
    return [f"tcp://{p.master_addr}:{port}" for port in ports]


def _kv_transfer(cfg: LlaunchConfig, endpoints: EndpointAllocator, rank: int) -> str:
    """Where decode rank `rank` receives KV; the scheme names the transport (tcp: ZMQ, nccl: NCCL pairs)."""
    base, host = cfg.mode.kv_transfer_port, cfg.server.host
    scheme = "nccl" if cfg.mode.kv_transport == KvTransport.nccl else "tcp"
    return f"{scheme}://{host}:{base + rank if base is not None else endpoints.free_port(host)}"


def _pd_master_address(cfg: LlaunchConfig) -> str:
    return f"http://{cfg.mode.pd_master_host}:{cfg.mode.pd_master_port}"


def _frontends(cfg: LlaunchConfig, text: list[str], requests: list[str], extra: dict[str, str]) -> list[ProcessSpec]:
    return [ProcessSpec(name=f"frontend.{i}", role="frontend", index=i, binds={"text": addr},
                        connects={f"requests.{d}": r for d, r in enumerate(requests)} | extra)
            for i, addr in enumerate(text)]


def _serving_graph(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> ProcessGraph:
    p, pd_node = cfg.parallel, cfg.mode.kind in (Mode.pd_prefill, Mode.pd_decode)
    controls = _controls(cfg, endpoints)
    dist_init = _dist_inits(cfg, endpoints)
    def local(name: str) -> str:  # frontends, detokenizer and routers run on node 0
        return endpoints.endpoint(name, _node_host(cfg, 0))

    text = [local(f"frontend.{i}.text") for i in range(cfg.server.http_workers)]
    tokens = local("detokenizer.tokens")
    per_node = p.tp * p.dp // p.nnodes
    routers, workers = [], []
    for d in range(p.dp):
        binds = {"requests": local(f"router.{d}.requests"), "results": local(f"router.{d}.results")}
        replica = []
        for r in range(p.tp):
            gpu = d * p.tp + r  # global index; each node numbers its own GPUs from 0
            node = gpu // per_node
            replica.append(ProcessSpec(
                name=f"worker.{d}.{r}", role="worker", dp_rank=d, tp_rank=r, node=node,
                gpus=[gpu % per_node] if cfg.device == Device.cuda else [],
                binds={"plan": endpoints.endpoint(f"worker.{d}.{r}.plan", _node_host(cfg, node))},
                connects={"results": binds["results"], "control": controls[node], "dist": dist_init[d]}))
        if cfg.mode.kind == Mode.pd_decode:  # every rank receives its KV heads (the rules keep dp1)
            for w in replica:
                w.binds["kv_transfer"] = _kv_transfer(cfg, endpoints, w.tp_rank)
        routers.append(ProcessSpec(
            name=f"router.{d}", role="router", dp_rank=d, binds=binds,
            connects={f"plan.{w.tp_rank}": w.binds["plan"] for w in replica}
            | {"tokens": tokens, "control": controls[0]}))
        workers += replica
    metrics = {"metrics": _url(cfg.server.metrics_host, cfg.server.metrics_port) + "/metrics"} \
        if cfg.server.metrics_port is not None else {}  # the hub's own listener, without the API key
    detokenizer = ProcessSpec(name="detokenizer", role="detokenizer", binds={"tokens": tokens} | metrics,
                              connects={f"text.{i}": addr for i, addr in enumerate(text)} | {"control": controls[0]})
    # a pd node's frontends register with the pd_master
    extra = {"pd_master": _pd_master_address(cfg)} if pd_node else {}
    if cfg.mode.kind == Mode.pd_decode:  # advertised to the master with the registration: rank r's is r-th
        extra["kv_transfer"] = ",".join(w.binds["kv_transfer"] for w in workers)
    frontends = _frontends(cfg, text, [r.binds["requests"] for r in routers], extra | {"control": controls[0]})
    hosts = _kv_hosts(cfg, workers, controls[0], routers)
    hosts += _visual_servers(cfg, local, routers, workers, controls[0], endpoints)
    return ProcessGraph(processes=[*hosts, *frontends, *routers, detokenizer, *workers], http_url=_http_url(cfg),
                        ipc_dir=_ipc_dir(endpoints), control=controls[p.node_rank], dist_init=dist_init)


def _kv_hosts(cfg: LlaunchConfig, workers: list[ProcessSpec], instance: str, routers=()) -> list[ProcessSpec]:
    """cache.cpu_tokens > 0: one kv_host process per node owns the host KV tier's shared memory, a
    file per worker of its node (runtime/cache/host_pool.py); each worker maps its own. cache.dp_fetch
    (one node): an index file per replica too, which every router maps, and each worker maps the pools
    of its tp rank in the other replicas."""
    if cfg.cache.cpu_tokens <= 0:
        return []
    hosts: dict[int, ProcessSpec] = {}
    for w in workers:
        host = hosts.setdefault(w.node, ProcessSpec(name=f"kv_host.{w.node}", role="kv_host", node=w.node,
                                                    connects={"control": w.connects["control"]}))
        path = pool_path(instance, w.dp_rank, w.tp_rank)
        host.binds[f"pool.{w.dp_rank}.{w.tp_rank}"] = path
        w.connects["kv_host"] = path
        if cfg.cache.dp_fetch:
            for d in range(cfg.parallel.dp):
                if d != w.dp_rank:
                    w.connects[f"kv_peer.{d}"] = pool_path(instance, d, w.tp_rank)
    if cfg.cache.dp_fetch:
        for d, router in enumerate(routers):
            hosts[0].binds[f"index.{d}"] = index_path(instance, d)
        for router in routers:
            router.connects.update({f"kv_index.{d}": index_path(instance, d) for d in range(len(routers))})
    return list(hosts.values())


def _visual_servers(cfg: LlaunchConfig, local, routers: list[ProcessSpec], workers: list[ProcessSpec],
                    instance: str, endpoints: EndpointAllocator) -> list[ProcessSpec]:
    """A multimodal model: visual.dp visual servers (runtime/encoder/process.py), each on its GPU
    (visual.devices, else the node's GPUs in turn), with its embed cache's file. An audio model: audio.dp
    of the same process, named audio.{a} (audio.devices); routers still dial them as visual.{a}."""
    if not multimodal(cfg):
        return []
    v, p = encoder_servers(cfg), cfg.parallel
    per_node = max(p.tp * p.dp // max(p.nnodes, 1), 1)
    servers = []
    for i in range(v.dp):
        gpus = [[v.devices[i * v.tp + r] if v.devices else (i * v.tp + r) % per_node] if cfg.device == Device.cuda
                else [] for r in range(v.tp)]
        dist = {"dist": f"tcp://127.0.0.1:{endpoints.free_port('127.0.0.1')}"} if v.tp > 1 else {}
        server = ProcessSpec(name=f"{v.kind}.{i}", role="visual", index=i, gpus=gpus[0],
                             binds={"encode": local(f"{v.kind}.{i}.encode"), "embeds": embeds_path(instance, i)},
                             connects={f"ready.{r.dp_rank}": r.binds["results"] for r in routers}
                             | {"control": instance} | dist)
        for r in routers:
            r.connects[f"visual.{i}"] = server.binds["encode"]
        for w in workers:
            w.connects[f"embeds.{i}"] = server.binds["embeds"]
        # visual.tp > 1: the followers of visual.{i}, its tower split over them (runtime/encoder/tower_tp.py)
        followers = [ProcessSpec(name=f"{v.kind}.{i}.{r}", role="visual", index=i, tp_rank=r, gpus=gpus[r],
                                 connects={"control": instance} | dist) for r in range(1, v.tp)]
        servers += [server, *followers]
    return servers


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _pd_master_graph(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> ProcessGraph:
    """One process serving HTTP twice: clients at server.host:port, instances registering at
    mode.pd_master_host:pd_master_port. It relays to the instances' own frontends, so it runs none."""
    m = cfg.mode
    control = _controls(cfg, endpoints)[0]
    connects = {"control": control}
    if m.config_server_host:
        connects["config_server"] = _url(m.config_server_host, m.config_server_port)
    master = ProcessSpec(name="pd_master", role="pd_master", connects=connects,
                         binds={"http": _http_url(cfg), "register": _url(m.pd_master_host, m.pd_master_port)})
    return ProcessGraph(processes=[master], http_url=_http_url(cfg), ipc_dir=_ipc_dir(endpoints), control=control)


def _config_server_graph(cfg: LlaunchConfig, endpoints: EndpointAllocator) -> ProcessGraph:
    m = cfg.mode
    control = _controls(cfg, endpoints)[0]
    url = _url(m.config_server_host, m.config_server_port)
    registry = ProcessSpec(name="config_server", role="config_server", connects={"control": control},
                           binds={"http": url})
    return ProcessGraph(processes=[registry], http_url=url, ipc_dir=_ipc_dir(endpoints), control=control)


def _ipc_dir(endpoints: EndpointAllocator) -> str:
    return "" if endpoints.tcp else endpoints.ipc_dir


def unmatched_connects(graph: ProcessGraph) -> list[tuple[str, str, str]]:
    """(process, key, address) of every dialled address no process binds, external keys excepted."""
    bound = {addr for spec in graph.processes for addr in spec.binds.values()}
    return [(spec.name, key, addr) for spec in graph.processes for key, addr in spec.connects.items()
            if addr not in bound and key not in EXTERNAL_KEYS]


def processes_on(graph: ProcessGraph, node: int) -> list[ProcessSpec]:
    """What the launcher of `node` starts (everything on a single node)."""
    return [spec for spec in graph.processes if spec.node == node]

