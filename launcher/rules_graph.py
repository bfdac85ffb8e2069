"""Rules over how the process graph runs on its hosts: the transport between processes, the CUDA MPS
daemon, decode CUDA graphs' context bound, LightLLM's tpsp mix mode (refused: not implemented), and dp
cache fetch (one host's shared memory)."""
from __future__ import annotations

from llaunch.launcher import mps
from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Device, ZmqMode


@rule()
def zmq_mode_fits_nodes(cfg):
    p = cfg.parallel
    if p.nnodes > 1 and p.zmq_mode == ZmqMode.ipc:
        yield ("parallel.zmq_mode", "parallel.nnodes"), (
            f"parallel.zmq_mode=ipc with parallel.nnodes={p.nnodes}: unix sockets do not reach other hosts; "
            "use parallel.zmq_mode=tcp (or auto)")


@rule()
def cuda_mps_needs_gpus(cfg):
    if cfg.parallel.cuda_mps and cfg.device == Device.cpu:
        yield ("parallel.cuda_mps", "device"), (
            "parallel.cuda_mps=true needs GPUs (device=cpu here): MPS shares a GPU between CUDA processes; "
            "set parallel.cuda_mps=false or device=cuda")


@rule(live="warn")
def cuda_mps_daemon_installed(cfg):
    if cfg.parallel.cuda_mps and cfg.device != Device.cpu and mps.control_binary() is None:
        yield ("parallel.cuda_mps",), (
            f"parallel.cuda_mps=true but {mps.CONTROL} is not on PATH: install the NVIDIA driver's MPS "
            "tools, or set parallel.cuda_mps=false")


@rule(needs=("model.max_model_len",))
def graph_max_len_in_range(cfg):
    limit, max_len = cfg.model.graph_max_len_in_batch, cfg.model.max_model_len
    if limit is not None and not 1 <= limit <= max_len:
        yield ("model.graph_max_len_in_batch", "model.max_model_len"), (
            f"model.graph_max_len_in_batch={limit} must be in 1..model.max_model_len={max_len} (null: "
            "every context the model serves)")


@rule()
def tpsp_mix_not_implemented(cfg):
    if cfg.parallel.tpsp_mix:
        yield ("parallel.tpsp_mix",), (
            "parallel.tpsp_mix=true (LightLLM's enable_tpsp_mix_mode) is not implemented: llaunch's tensor "
            "parallelism all-reduces the full residual after attention and the MLP; the sequence-parallel "
            "split (reduce-scatter, norms on 1/tp of the tokens, all-gather) is not built. "
            "Set parallel.tpsp_mix=false")


@rule()
def dp_fetch_supported(cfg):
    c, p = cfg.cache, cfg.parallel
    if not c.dp_fetch:
        return
    if p.dp < 2 or c.cpu_tokens <= 0:
        yield ("cache.dp_fetch", "parallel.dp", "cache.cpu_tokens"), (
            f"cache.dp_fetch=true with parallel.dp={p.dp} and cache.cpu_tokens={c.cpu_tokens}: replicas fetch "
            "prefixes from each other's host KV tier, so it needs parallel.dp >= 2 and cache.cpu_tokens > 0; "
            "set those, or cache.dp_fetch=false")
    if p.nnodes > 1:
        yield ("cache.dp_fetch", "parallel.nnodes"), (
            f"cache.dp_fetch=true with parallel.nnodes={p.nnodes}: replicas fetch through shared memory on one "
            "host only; set cache.dp_fetch=false or parallel.nnodes=1")
