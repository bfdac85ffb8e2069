"""The API key (a secret) reaches the processes that check it on their stdin: never on a command
line (`ps` shows those) and never in the run directory, whose config.yaml holds REDACTED instead."""
from __future__ import annotations

import sys
from typing import Optional

from llaunch.runtime.config import RunConfig

REDACTED = "<redacted>"


def read_api_key(cfg: RunConfig) -> Optional[str]:
    """The key this process checks requests against: from stdin when the run config says REDACTED."""
    if cfg.server.api_key != REDACTED:
        return cfg.server.api_key
    key = sys.stdin.readline().rstrip("\n")
    if not key:
        raise SystemExit("server.api_key is redacted in the run config, but the launcher sent no key on stdin")
    return key
