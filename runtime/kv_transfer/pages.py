"""Moving one request's KV from a prefill instance to a decode instance: the interface both transports
implement (KvSender / KvReceiver returning a TransferHandle), the page plan, the header every page
travels with, and the gather/scatter between cache slots and a contiguous page.

A page is `page_tokens` tokens across all layers, K and V: a tensor [2, layers, tokens, kv_heads,
head_dim]. Sending in pages bounds the staging memory and lets a transfer overlap with compute.
"""
from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import msgspec
import torch

from llaunch.runtime.models.batch import KvCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV transfer does not carry dtype {dtype}; known: {sorted(DTYPES)}")
    return _DTYPE_NAMES[dtype]


# ---- wire messages (msgspec, no pickle) ---------------------------------------------------------


class KvPageHeader(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Precedes the raw bytes of one page; the receiver checks it against its own cache."""

    request_id: str
    page: int  # 0-based, pages of one request arrive in order
    first_token: int  # offset of the page's first token within the transferred tokens
    num_tokens: int
    total_tokens: int  # of the whole transfer: must equal the receiver's len(dst_slots)
    num_layers: int
    dtype: str  # a key of DTYPES
    shape: list[int]  # of the payload: [2, num_layers, num_tokens, kv_heads, head_dim]

    @property
    def payload_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPES[self.dtype].itemsize if self.dtype in DTYPES else -1


class KvAbort(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The sender gave up on a request (its side failed): the receiver fails it at once."""

    request_id: str
    reason: str


KvToReceiver = Union[KvPageHeader, KvAbort]

# ---- handles ------------------------------------------------------------------------------------


class TransferError(RuntimeError):
    pass


class TransferHandle:
    """One request's transfer as seen by one side. Finished once: ok (error is None) or failed."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.error: Optional[str] = None
        self.tokens_done = 0  # sender: tokens the peer acknowledged; receiver: tokens written
        self._finished = threading.Event()
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def ok(self) -> bool:
        return self.done() and self.error is None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once finished (ok or failed); False if still running after `timeout` seconds."""
        return self._finished.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> None:
        """Wait, then raise TransferError if the transfer failed or did not finish in time."""
        if not self.wait(timeout):
            raise TransferError(f"{self.request_id}: transfer still running after {timeout}s")
        if self.error is not None:
            raise TransferError(f"{self.request_id}: {self.error}")

    def finish(self, error: Optional[str] = None) -> bool:
        """Called by the transport; the first call wins. Returns whether this call finished it."""
        with self._lock:
            if self._finished.is_set():
                return False
            self.error = error
            self._finished.set()
            return True

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("ok" if self.error is None else f"failed: {self.error}")
        return f"TransferHandle({self.request_id!r}, {state})"


class KvSender(ABC):
    """Prefill side. `send` returns at once; the transport gathers and sends pages in the background.
    The caller keeps `src_slots` allocated until the handle is done (ok or not), then frees them."""

    @abstractmethod
    def send(self, request_id: str, src_slots: list[int], kv: KvCache) -> TransferHandle: ...

    @abstractmethod
    def close(self) -> None: ...


class KvReceiver(ABC):
    """Decode side. `recv` registers already allocated `dst_slots` for a request; pages arriving for
    it (also ones that arrived before the call) are written there. The KV is usable once the handle
    is ok; on failure the caller frees `dst_slots` and ends the request with the handle's error."""

    @abstractmethod
    def recv(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle: ...

    @abstractmethod
    def close(self) -> None: ...


# ---- pages --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    index: int
    first_token: int
    num_tokens: int


def plan_pages(num_tokens: int, page_tokens: int) -> list[Page]:
    if page_tokens <= 0:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    return [Page(i, first, min(page_tokens, num_tokens - first))
            for i, first in enumerate(range(0, num_tokens, page_tokens))]


def page_shape(kv: KvCache, num_tokens: int) -> list[int]:
    _, heads, head_dim = kv.k[0].shape
    return [2, len(kv.k), num_tokens, heads, head_dim]


def page_header(request_id: str, page: Page, total_tokens: int, kv: KvCache) -> KvPageHeader:
    return KvPageHeader(request_id=request_id, page=page.index, first_token=page.first_token,
                        num_tokens=page.num_tokens, total_tokens=total_tokens, num_layers=len(kv.k),
                        dtype=dtype_name(kv.k[0].dtype), shape=page_shape(kv, page.num_tokens))


def gather_page(kv: KvCache, slots: torch.Tensor) -> torch.Tensor:
    """K and V of `slots` in every layer, into one contiguous page on the cache's device."""
    out = torch.empty(page_shape(kv, slots.numel()), dtype=kv.k[0].dtype, device=kv.k[0].device)
    for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
        torch.index_select(k, 0, slots, out=out[0, layer])
        torch.index_select(v, 0, slots, out=out[1, layer])
    return out


def scatter_page(kv: KvCache, slots: torch.Tensor, page: torch.Tensor) -> None:
    for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
        k.index_copy_(0, slots, page[0, layer])
        v.index_copy_(0, slots, page[1, layer])


def check_header(header: KvPageHeader, kv: KvCache, num_dst_slots: int, tokens_done: int) -> Optional[str]:
    """Why this page cannot be written into the receiver's cache, or None if it can."""
    if header.dtype != _DTYPE_NAMES.get(kv.k[0].dtype):
        return f"dtype {header.dtype} does not match the receiver's KV dtype {kv.k[0].dtype}"
    if header.total_tokens != num_dst_slots:
        return f"sender transfers {header.total_tokens} tokens, receiver allocated {num_dst_slots} slots"
    expected = page_shape(kv, header.num_tokens)
    if header.num_layers != len(kv.k) or list(header.shape) != expected:
        return f"page shape {list(header.shape)} does not match the receiver's {expected}"
    if header.first_token != tokens_done or header.num_tokens <= 0:
        return f"page {header.page} starts at token {header.first_token}, expected {tokens_done}"
    if header.first_token + header.num_tokens > num_dst_slots:
        return f"page {header.page} runs past the {num_dst_slots} allocated slots"
    return None


def to_wire(page: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU page (the tensor stays alive through the view)."""
    return memoryview(page.contiguous().view(torch.uint8).reshape(-1).numpy())


def from_wire(buffer: memoryview, header: KvPageHeader) -> torch.Tensor:
    """The page a header describes, copied out of a received (read-only) buffer."""
    staging = torch.empty(header.payload_bytes, dtype=torch.uint8)
    memoryview(staging.numpy())[:] = buffer  # raises if the byte count is wrong
    return staging.view(DTYPES[header.dtype]).view(header.shape)


# ---- ordering against the caller's compute ------------------------------------------------------


def compute_done_marker(kv: KvCache) -> Optional["torch.cuda.Event"]:
    """Recorded by `send` on the caller's current stream: the transfer waits for the KV it computed."""
    if not kv.k[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class SideStream:
    """Transfer copies run on their own CUDA stream, so they overlap with the model's; on CPU the
    transport's thread is the overlap and this does nothing."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}

    @contextlib.contextmanager
    def run(self, device: torch.device, after: Optional["torch.cuda.Event"] = None) -> Iterator[None]:
        if device.type != "cuda":
            yield
            return
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()  # the copies are complete before the bytes go out / the handle is done
