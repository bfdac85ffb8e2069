"""Host ↔ device copies that never stall the host: a plain `torch.tensor(list, device="cuda")`
synchronizes with the stream, which would wait for the step already running and undo the overlap
of host and device work. Pinned staging (PyTorch's caching host allocator keeps each buffer alive
until its copy has run) makes the copy asynchronous."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, enqueued on the stream: valid once an event recorded
    after it has fired, so the host never waits for work queued behind it."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
