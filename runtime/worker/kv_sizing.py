"""How many KV token slots a rank can hold: an explicit cache.max_total_tokens, else the memory
left after weights and a reserve for activations (CUDA), or a fixed budget (CPU). The smallest over
the tp ranks wins, since every rank caches the same tokens."""
from __future__ import annotations

import torch

from llaunch.runtime.config import KvTransport, Mode
from llaunch.runtime.kv_transfer.nccl_pairing import NCCL_PAIR_RESERVE, NCCL_PARKING_BYTES
from llaunch.runtime.models.memory import GiB, activation_bytes


def activation_reserve_bytes(cfg, model) -> int:
    """Peak transient memory of one step (runtime/models/memory.py) and what the KV transport holds."""
    return activation_bytes(cfg, model.arch) + kv_link_reserve_bytes(cfg)


def kv_link_reserve_bytes(cfg) -> int:
    """Device memory the NCCL KV transport of a prefill/decode instance takes outside PyTorch's view.
    A prefill instance learns the transport from each decode instance's address, so it always
    reserves; a decode instance only with mode.kv_transport=nccl."""
    if cfg.mode.kind == Mode.pd_prefill:
        return NCCL_PAIR_RESERVE
    if cfg.mode.kind == Mode.pd_decode and cfg.mode.kv_transport == KvTransport.nccl:
        return NCCL_PAIR_RESERVE + NCCL_PARKING_BYTES
    return 0


def kv_slots_for(cfg, model, device: torch.device, group=None, extra_per_token: int = 0) -> int:
    """Slots every rank of the replica can hold. Each rank sizes from its own memory; the MIN over
    the group is taken before the fit check, so all ranks agree and fail together (a lone rank that
    raised would leave its peers waiting in the all-reduce). `extra_per_token`: what else a slot
    holds (a draft model's KV)."""
    per_token = model.kv_bytes_per_token + extra_per_token
    used = 0
    if cfg.cache.max_total_tokens:
        budget = int(cfg.cache.max_total_tokens) * per_token
    elif device.type == "cpu":
        budget = int(cfg.cache.cpu_kv_gib * GiB)
    else:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights and whatever else is resident
        budget = int(total * cfg.cache.mem_fraction - used - activation_reserve_bytes(cfg, model))
    slots = min(budget // per_token, cfg.router.max_running_requests * cfg.model.max_model_len)
    if group is not None:
        slots = _group_min(slots, device, group)
    if device.type == "cuda" and not cfg.cache.max_total_tokens and slots <= cfg.model.max_model_len:
        raise RuntimeError(
            f"KV cache does not fit: {slots * per_token / GiB:.1f} GiB left for it (on the tightest rank) after "
            f"weights ({used / GiB:.1f} GiB here) within cache.mem_fraction={cfg.cache.mem_fraction}; raise "
            f"cache.mem_fraction, lower router.batch_max_tokens, or use more GPUs (parallel.tp)")
    return max(slots, 0)


def _group_min(value: int, device: torch.device, group) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
