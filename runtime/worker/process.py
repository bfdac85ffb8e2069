"""Worker process: one per GPU rank (or one CPU process per rank). Loads its shard of the model,
sizes its KV cache, then runs every StepPlan the router sends; rank 0 returns the sampled tokens
(every rank samples the same tokens: same logits, same counter-based noise)."""
from __future__ import annotations

import logging
import os
import time

import torch
import zmq

from llaunch.launcher.schema import RunConfig
from llaunch.runtime import bootstrap
from llaunch.runtime.ipc.messages import Shutdown, WorkerInbound, WorkerReady
from llaunch.runtime.ipc.sockets import Receiver, Sender
from llaunch.runtime.worker.kv_sizing import kv_slots_for
from llaunch.runtime.worker.runner import ModelRunner

log = logging.getLogger("llaunch.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_distributed(cfg: RunConfig, spec):
    """The tp ranks of one replica form a process group (NCCL on GPUs, gloo on CPU)."""
    tp = cfg.parallel.tp
    if tp == 1:
        return None
    import torch.distributed as dist

    backend = "nccl" if cfg.device.value == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=spec.connects["dist"], world_size=tp, rank=spec.tp_rank)
    return dist.group.WORLD


def main() -> None:
    cfg, spec = bootstrap.start()
    if cfg.device.value == "cpu":
        # ranks of one replica share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (cfg.parallel.tp * cfg.parallel.dp)))
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)  # the launcher sets CUDA_VISIBLE_DEVICES to this rank's GPU
        torch.cuda.set_device(device)
    group = init_distributed(cfg, spec)
    dtype = DTYPES[cfg.model.dtype.value]

    from llaunch.runtime.models import build_model

    model = build_model(cfg.model, device=device, dtype=dtype, tp_rank=spec.tp_rank, tp_size=cfg.parallel.tp,
                        process_group=group)
    num_slots = kv_slots_for(cfg, model, device, group)
    max_rows = cfg.router.max_running_requests
    # one extra row and slot: scratch space that padded CUDA-graph rows read and write
    kv = model.make_kv_cache(num_slots + 1, max_rows + 1, cfg.model.max_model_len)
    runner = ModelRunner(model, kv, max_rows, device, cuda_graphs=not cfg.model.enforce_eager)
    log.info("model loaded: %s %s on %s, %d KV slots", cfg.model.name, dtype, device, num_slots)

    ctx = zmq.Context()
    plans = Receiver(ctx, spec.binds["plan"], WorkerInbound)
    results = Sender(ctx, spec.connects["results"]) if spec.tp_rank == 0 else None
    if results is not None:
        results.send(WorkerReady(kv_slots=num_slots, max_running_requests=max_rows))
    bootstrap.report_ready(ctx, cfg, spec, kv_slots=num_slots)
    serve(runner, plans, results, overlap=device.type == "cuda")


def serve(runner: ModelRunner, plans: Receiver, results, overlap: bool) -> None:
    """Run plans in order. With `overlap`, step N+1 is launched before step N's tokens are read,
    so the device is busy while the host prepares the next step."""
    pending = None

    def send(step):
        result = runner.finish(step)
        if results is not None:
            results.send(result)

    while True:
        msg = plans.recv_nowait() if pending is not None else plans.recv()
        if msg is None:
            if runner.ready(pending):
                send(pending)
                pending = None
            else:
                time.sleep(20e-6)
            continue
        if isinstance(msg, Shutdown):
            break
        step = runner.launch(msg)
        if not overlap:
            send(step)
            continue
        if pending is not None:
            send(pending)
        pending = step


if __name__ == "__main__":
    main()
