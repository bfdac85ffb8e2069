"""The API key on its way from the user to the frontends: read once here (server.api_key, which
conf/server/default.yaml fills from $LLAUNCH_API_KEY, or server.api_key_file), replaced by REDACTED
in everything written to the run directory (config.yaml, Hydra's .hydra/ copies of the config and
the command line), and handed to the processes that check it on their stdin (launcher/supervise.py)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from llaunch.runtime.api_key import REDACTED
from llaunch.runtime.config import LlaunchConfig


def read_key_file(path: str) -> str:
    """The first line of the key file, stripped ('' when the file is empty)."""
    with open(path) as f:
        return f.readline().strip()


def api_key(cfg: LlaunchConfig) -> Optional[str]:
    s = cfg.server
    if s.api_key:
        return s.api_key
    return read_key_file(s.api_key_file) if s.api_key_file else None


def redacted(cfg: LlaunchConfig) -> LlaunchConfig:
    """`cfg` as the run directory may hold it."""
    has_key = api_key(cfg) is not None
    return replace(cfg, server=replace(cfg.server, api_key=REDACTED if has_key else None))


def scrub(run_dir: Path, key: Optional[str]) -> None:
    """Replace the key in Hydra's copies of the config and overrides (a key given on the command line)."""
    if not key:
        return
    for path in (run_dir / ".hydra").glob("*.yaml"):
        text = path.read_text()
        if key in text:
            path.write_text(text.replace(key, REDACTED))
