"""What a PD deployment's HTTP processes say to each other: the headers a pd_master adds to a request
it relays to a prefill and a decode instance's frontend, and the heartbeat body an instance registers
with (runtime/web/registrar.py sends it, runtime/pd_master/registry.py keeps it)."""
from __future__ import annotations

from typing import Literal, Optional

import msgspec

# Headers the pd_master (runtime/pd_master/relay.py) sends with a relayed request
PD_ID_HEADER = "X-Llaunch-Pd-Id"  # to P and D: pairs P's KV shipment with D's waiting request
DECODE_KV_HEADER = "X-Llaunch-Pd-Decode-Kv"  # to P only: D's kv_address


class InstanceLoad(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0  # share of the KV slots in use, 0..1


class Registration(msgspec.Struct):
    """The body an instance POSTs to /pd/register every heartbeat interval."""

    id: str
    role: Literal["prefill", "decode"]
    url: str  # the instance's own llaunch HTTP server, e.g. http://10.0.0.2:8000
    kv_address: Optional[str] = None  # decode: where prefill instances ship the KV (tcp://host:port)
    model: str = ""
    load: InstanceLoad = msgspec.field(default_factory=InstanceLoad)
