"""Worker process: one per GPU rank (or one CPU process per rank). Loads its shard of the model,
sizes its KV cache, then runs every StepPlan the router sends; rank 0 returns the sampled tokens
(every rank samples the same tokens: same logits, same counter-based noise).

A replica may span nodes (parallel.nnodes > 1), and node 0 runs its router. Two watches make a worker
exit (EXIT_PEER_GONE) when what it depends on elsewhere is gone, so no node waits forever for a node
that stopped: `PeerWatch` (another tp rank's process exited) and `RouterWatch` (a worker off node 0
lost its router's connection)."""
from __future__ import annotations

import datetime
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import zmq

from llaunch.runtime.config import Mode, RunConfig
from llaunch.kernels import settings as kernel_settings
from llaunch.runtime import bootstrap
from llaunch.runtime.cpu_quota import usable_cpus
from llaunch.runtime.ipc.messages import (CancelKv, PrepareConstraints, Profile, ReceiveKv, SendKv, Shutdown,
                                          StepPlan, WorkerInbound, WorkerReady)
from llaunch.runtime.ipc.sockets import Receiver, Sender, SocketMonitor
from llaunch.runtime.models.kv_fp8 import use_fp8_kv
from llaunch.runtime.kv_transfer.link import KvLink, KvTransportStuck
from llaunch.runtime.worker.constraint_prep import ConstraintPrep
from llaunch.runtime.worker.drafter import Drafter, draft_kv_cache
from llaunch.runtime.worker.fp8_device import fp8_problem
from llaunch.runtime.worker.image_rows import ImageRows
from llaunch.runtime.models.vision_qwen2 import VisionArch
from llaunch.runtime.encoder_servers import encoder_servers, multimodal
from llaunch.runtime.cache.embed_reader import ShmEmbeds, image_tokens
from llaunch.runtime.worker.audio_rows import AudioRows
from llaunch.runtime.models.audio_qwen2 import audio_tokens
from llaunch.runtime.worker.host_kv import HostKvPool
from llaunch.runtime.worker.kv_sizing import kv_slots_for
from llaunch.runtime.worker.runner import ModelRunner
from llaunch.runtime.worker.step_profiler import StepProfiler
from llaunch.runtime.models.memory import mixed_graph_tokens, spec_step_tokens

log = logging.getLogger("llaunch.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PEER_WATCH_PERIOD_S = 1.0
# A live peer answers within one period; this only bounds a peer that hangs without exiting.
PEER_WATCH_TIMEOUT = datetime.timedelta(seconds=120)
EXIT_PEER_GONE = 3  # exit status when a tp peer or the router went away (launcher/supervise.py)
EXIT_KV_STUCK = 4  # exit status when a NCCL KV transfer left the GPU stuck


def _exit_peer_gone(message: str, *args) -> None:
    """From a watch thread: the main thread may be blocked in a collective or a recv for good."""
    log.error(message + "; exiting", *args)
    logging.shutdown()
    os._exit(EXIT_PEER_GONE)


class PeerWatch:
    """Every rank all-reduces one number per period on a gloo side group. When a peer's process
    exits (its node was stopped, or it crashed), gloo fails at once on every other rank, which then
    exits: the launcher of each node sees its worker die and tears its part of the graph down."""

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank
        self.stopping = False  # set at a clean Shutdown: peers leaving then is expected

    def start(self) -> None:
        threading.Thread(target=self._run, name="peer-watch", daemon=True).start()

    def _run(self) -> None:
        import torch.distributed as dist

        beat = torch.zeros(1)
        while True:
            try:
                dist.all_reduce(beat, group=self.group)
            except Exception as e:  # gloo: connection reset / closed by peer, or the timeout
                if self.stopping:
                    return
                reason = str(e).split(". This is typically")[0].splitlines()[0]
                _exit_peer_gone("tp rank %d: a peer rank of this replica is gone (%s)", self.rank, reason)
            time.sleep(PEER_WATCH_PERIOD_S)


class RouterWatch:
    """Follows the connections to this worker's plan socket (its monitor): once the router has
    connected, its connection dropping means node 0 stopped and no plan will come any more. Only
    for workers off node 0: on node 0 the launcher tears everything down itself."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context):
        self.monitor = SocketMonitor(ctx, "router-watch", self.EVENTS)  # give it to the plan socket's Receiver
        self.plan_address = "?"

    def start(self, plans: Receiver) -> None:
        self.plan_address = plans.address
        threading.Thread(target=self._run, name="router-watch", daemon=True).start()

    def _run(self) -> None:
        accepted = router = None  # connection fds; the router's is the first to complete a ZMQ handshake
        while True:
            kind, fd = self.monitor.recv()
            if kind == zmq.EVENT_ACCEPTED:
                accepted = fd
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and router is None:
                router = accepted
            elif kind == zmq.EVENT_DISCONNECTED and router is not None and fd == router:
                _exit_peer_gone("the router's connection to %s dropped (node 0 stopped?)", self.plan_address)


def init_distributed(cfg: RunConfig, spec):
    """The tp ranks of one replica form a process group (NCCL on GPUs, gloo on CPU), plus a gloo
    side group for PeerWatch. Returns (group, watch); (None, None) without tensor parallelism."""
    tp = cfg.parallel.tp
    if tp == 1:
        return None, None
    import torch.distributed as dist

    backend = "nccl" if cfg.device.value == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=spec.connects["dist"], world_size=tp, rank=spec.tp_rank)
    side = dist.new_group(backend="gloo", timeout=PEER_WATCH_TIMEOUT)
    log.info("tp rank %d/%d joined %s (%s)", spec.tp_rank, tp, spec.connects["dist"], backend)
    return dist.group.WORLD, PeerWatch(side, spec.tp_rank)


def cpu_threads(cfg: RunConfig, root: Path = Path("/")) -> int:
    """device_threads when set; else the worker ranks on one node share the CPUs this process may use
    (its affinity and cgroup quota: runtime/cpu_quota.py), each node running tp*dp/nnodes of them."""
    if cfg.device_threads > 0:
        return cfg.device_threads
    p = cfg.parallel
    local_ranks = max(1, p.tp * p.dp // max(p.nnodes, 1))
    return max(1, usable_cpus(root) // local_ranks)


def main() -> None:
    cfg, spec = bootstrap.start()
    kernel_settings.configure(cfg.kernels)  # before any kernel launches or graph captures
    if cfg.device.value == "cpu":
        torch.set_num_threads(cpu_threads(cfg))
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)  # the launcher sets CUDA_VISIBLE_DEVICES to this rank's GPU
        torch.cuda.set_device(device)
    ctx = zmq.Context()
    stage = bootstrap.StageReporter(ctx, cfg, spec)
    if cfg.parallel.tp > 1:
        stage(f"joining its {cfg.parallel.tp} tp ranks")
    group, watch = init_distributed(cfg, spec)
    dtype = DTYPES[cfg.model.dtype.value]

    from llaunch.runtime.models.loader import build_model

    loading = f"loading weights ({cfg.model.load_format.value}, {cfg.model.dtype.value})"
    stage(loading)
    model = build_model(cfg.model, device=device, dtype=dtype, tp_rank=spec.tp_rank, tp_size=cfg.parallel.tp,
                        process_group=group, progress=stage.fraction(loading), expert_parallel=cfg.parallel.ep > 1)
    images = None
    embeds = [spec.connects[f"embeds.{v}"] for v in range(encoder_servers(cfg).dp)] if multimodal(cfg) else []
    if cfg.model.vision:  # image embeddings come from the visual servers' embed cache (runtime/cache/embed_reader.py)
        arch = VisionArch.from_dict(cfg.model.vision)
        images = ImageRows(ShmEmbeds(embeds, image_tokens(arch.spatial_merge_size), arch.hidden_size, dtype, device,
                                     cfg.server.ready_timeout_s), arch.spatial_merge_size)
    elif cfg.model.audio:  # Qwen2-Audio: clip embeddings from the same servers' cache
        images = AudioRows(ShmEmbeds(embeds, lambda clip: audio_tokens(clip.grid[0]),
                                     int(cfg.model.audio["hidden_size"]), dtype, device, cfg.server.ready_timeout_s))
    draft = None
    if cfg.draft_model is not None:  # spec.method=draft: whole on every rank (small), before the KV is sized
        stage("loading the draft model")
        draft = build_model(cfg.draft_model, device=device, dtype=dtype)
    kv_calibration = use_fp8_kv(model, cfg.cache, cfg.run_dir)  # cache.kv_dtype=fp8_e4m3: before sizing
    if device.type == "cuda":
        problem = fp8_problem(model, model.kv_dtype == torch.float8_e4m3fn,
                              torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
        if problem:
            raise RuntimeError(problem)
    if kv_calibration is not None:
        kv_calibration.start()
    stage("sizing the KV cache")
    num_slots = kv_slots_for(cfg, model, device, group, extra_per_token=draft.kv_bytes_per_token if draft else 0)
    max_rows = cfg.router.max_running_requests
    spec_batch = min(cfg.spec.max_batch, max_rows)
    # spec.draft_ahead: slots the router never allocates, before the scratch one, which the draft's proposals
    # drafted ahead write (in the model's cache too: a table entry left pointing there stays in its range)
    ahead = Drafter.ahead_slots(cfg.spec.num_tokens, spec_batch) if draft and cfg.spec.draft_ahead else 0
    # one extra row and slot: scratch space that padded CUDA-graph rows read and write
    kv = model.make_kv_cache(num_slots + ahead + 1, max_rows + 1, cfg.model.max_model_len)
    drafter = Drafter(draft, draft_kv_cache(draft, kv), model.arch.vocab_size, device, group,
                      num_tokens=cfg.spec.num_tokens, max_batch=spec_batch, ahead=ahead > 0) if draft else None
    host_kv = None  # the host KV tier's pool (cache.cpu_tokens), made by the kv_host process
    if cfg.cache.cpu_tokens > 0:
        stage("mapping the host KV pool")
        peers = {int(k.split(".")[1]): p for k, p in spec.connects.items() if k.startswith("kv_peer.")}  # cache.dp_fetch
        host_kv = HostKvPool(kv, spec.connects["kv_host"], cfg.cache.cpu_tokens, device, cfg.server.ready_timeout_s,
                             peers)
    if device.type == "cuda":
        stage("capturing CUDA graphs and compiling kernels" if not cfg.model.enforce_eager else "compiling kernels")
    grammars = grammar_compiler(cfg)  # one compiler: the router's prepares fill the cache the steps read
    runner = ModelRunner(model, kv, max_rows, device, cuda_graphs=not cfg.model.enforce_eager,
                         prefill_graph_tokens=cfg.model.prefill_graph_tokens,
                         timed=cfg.router.step_trace is not None, eos_ids=tuple(cfg.model.eos_token_ids or ()),
                         grammar=grammars, graph_max_len=cfg.model.graph_max_len_in_batch, images=images,
                         verify_tokens=spec_step_tokens(cfg.spec, max_rows), drafter=drafter,
                         pooling=cfg.model.pooling, mixed_graph_tokens=mixed_graph_tokens(cfg))
    log.info("model loaded: %s %s on %s, %d KV slots", cfg.model.name, dtype, device, num_slots)
    if watch is not None:
        watch.start()  # after loading: every rank is past the slow, GIL-heavy start-up

    stage.close()
    watch = RouterWatch(ctx) if spec.node != 0 else None
    plans = Receiver(ctx, spec.binds["plan"], WorkerInbound, monitor=watch.monitor if watch else None)
    if watch is not None:
        watch.start(plans)
    # every rank says it is loaded and warm (the router serves, and readiness turns green, only then);
    # rank 0 returns the tokens, and every rank reports its own KV transfers and compiles
    results = Sender(ctx, spec.connects["results"])
    results.send(WorkerReady(kv_slots=num_slots, max_running_requests=max_rows, tp_rank=spec.tp_rank))
    bootstrap.report_ready(ctx, cfg, spec, kv_slots=num_slots)
    link = None
    if cfg.mode.kind in (Mode.pd_prefill, Mode.pd_decode):
        link = KvLink(kv, spec.binds.get("kv_transfer"), scratch_slot=kv.num_slots - 1, tp_rank=spec.tp_rank)
        log.info("KV transfer: %s", f"receiving on {spec.binds['kv_transfer']}" if "kv_transfer" in spec.binds
                 else "sending")
    try:
        serve(runner, plans, results if spec.tp_rank == 0 else None, overlap=device.type == "cuda", link=link,
              kv_results=results, prep=ConstraintPrep(grammars), host_kv=host_kv,
              profiler=StepProfiler(cfg.server.profile_dir, f"worker-{spec.dp_rank}-{spec.tp_rank}",
                                    device.type == "cuda"))
    except KvTransportStuck as e:
        # Closing the link or CUDA's teardown can block behind the stuck kernel: leave now; the
        # launcher sees the worker die and takes the instance down, the pd_master marks it unhealthy.
        log.error("%s", e)
        logging.shutdown()
        os._exit(EXIT_KV_STUCK)
    finally:
        if link is not None:
            link.close()
    if watch is not None:
        watch.stopping = True
    if kv_calibration is not None:
        kv_calibration.write()
        log.info("KV calibration written to %s", cfg.cache.kv_calibration)


def grammar_compiler(cfg: RunConfig):
    """A factory of the worker's GrammarCompiler: the tokenizer loads on the first structured request."""

    @functools.cache
    def make():
        from llaunch.runtime.constrained.compiler import GrammarCompiler
        from llaunch.runtime.models.tokenizer import load_tokenizer

        return GrammarCompiler(load_tokenizer(cfg.model), cfg.model.vocab_size)

    return make


def log_admitted(plan: StepPlan) -> None:
    """One line per step that starts requests: which replica served which request."""
    if plan.new:
        log.info("step %d: %d new request(s): %s", plan.step, len(plan.new), " ".join(n.request_id for n in plan.new))


def serve(runner: ModelRunner, plans: Receiver, results, overlap: bool, link: Optional[KvLink] = None,
          kv_results=None, prep: Optional[ConstraintPrep] = None, host_kv: Optional[HostKvPool] = None,
          profiler: Optional[StepProfiler] = None) -> None:
    """Run plans in order. With `overlap`, step N+1 is launched before step N's tokens are read,
    so the device is busy while the host prepares the next step. With a KV `link`, transfer
    commands start between steps and their ends are reported as they come; with `prep`, grammars the
    router asks for compile meanwhile and each rank reports them (`kv_results`: every rank's sender);
    with `profiler`, Profile messages start and stop torch.profiler between steps."""
    pending = None
    prep = prep or ConstraintPrep(None)
    profiler = profiler or StepProfiler(None, "worker", False)

    def send(step):
        result = runner.finish(step)
        if results is not None:
            results.send(result)

    while True:
        if prep.pending:
            ready = prep.poll()
            if ready is not None:
                kv_results.send(ready)
        if prep.pending and pending is None:  # a compile's end must be reported while nothing runs
            msg = plans.recv(timeout_ms=1)
        elif link is not None and link.busy:
            for done in link.poll():
                kv_results.send(done)
            msg = plans.recv(timeout_ms=1) if pending is None else plans.recv_nowait()
        elif link is not None:  # idle, but a stuck transport must still end the worker within ~0.1 s
            msg = plans.recv_nowait() if pending is not None else plans.recv(timeout_ms=100)
        else:
            msg = plans.recv_nowait() if pending is not None else plans.recv()
        if link is not None:
            link.check()  # before the message can put work on a GPU that a stuck transfer blocks
        if isinstance(msg, (SendKv, ReceiveKv, CancelKv)):
            link.start(msg)  # a send waits on the device for the steps launched so far
            continue
        if isinstance(msg, PrepareConstraints):
            failed = prep.start(msg)
            if failed is not None:
                kv_results.send(failed)
            continue
        if msg is None:
            if pending is None:
                continue
            if runner.ready(pending):
                send(pending)
                pending = None
            else:
                time.sleep(20e-6)
            continue
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, Profile):
            if msg.start:
                profiler.handle(msg)
            else:  # the steps launched so far end inside the profile
                if pending is not None:
                    send(pending)
                    pending = None
                profiler.stop()
            continue
        if results is not None:
            log_admitted(msg)
        if host_kv is not None:  # host-tier copies first: the forward may read or reuse their slots
            host_kv.apply(msg.kv_moves)
        step = runner.launch(msg)
        profiler.stepped()
        if step.deferred is not None:  # its masks need the tokens of the step before: read them first
            if pending is not None:
                send(pending)
                pending = None
            runner.sample_deferred(step)
        if not overlap or profiler.due:
            if pending is not None:
                send(pending)
                pending = None
            send(step)
            if profiler.due:  # its last step is finished: the profile ends here
                profiler.stop()
            continue
        if pending is not None:
            send(pending)
        pending = step


if __name__ == "__main__":
    main()
