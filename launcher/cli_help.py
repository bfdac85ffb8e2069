"""`llaunch --help` (the profiles of each group and every key with its type, default and description,
from the schema) and `llaunch --version`."""
from __future__ import annotations

import shutil
import textwrap
from importlib import metadata

from llaunch.launcher import config_keys, store

HEADER = """\
llaunch: serve Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 / Phi-4 checkpoints (and the
Qwen-MoE / Mixtral experts) behind an OpenAI-compatible HTTP API.
Profiles compose the config; rules check it; a dry run prints the process graph.

  llaunch                                               the default model on this machine
  llaunch model=qwen2 model.path=/ckpt/Qwen2-7B-Instruct server.port=8080
  llaunch model=auto model.path=/ckpt/Qwen3-8B            the family from config.json (gemma2, gemma3_text, phi3, ...)
  llaunch model=qwen2-7b model.load_format=dummy parallel=tp2 device=cuda dry_run=true
  llaunch -m bench=smoke router.max_running_requests=4,8      a sweep: one server + benchmark per job
"""
FOOTER = """\
Exit codes: 0 ok; 2 invalid configuration (each violated rule or unknown key is named, and each key
set where nothing reads it, e.g. spec.num_tokens with spec=none); else the serving graph's status.
`--cfg job` prints the composed config; `--hydra-help` Hydra's own options."""


def version() -> str:
    try:
        return metadata.version("llaunch")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def render(width: int = 0) -> str:
    width = width or min(max(shutil.get_terminal_size((100, 24)).columns, 60), 120)
    lines = [HEADER, "Profiles (group=option):"]
    lines += [f"  {group}: {', '.join(store.profiles(group))}" for group in store.GROUPS]
    lines += ["", "Keys (key=value; a type ending in ? may be null):"]
    for key in config_keys.all_keys():
        lines.append(f"  {key.name}  {key.type} = {key.default}")
        lines += textwrap.wrap(key.doc, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines + ["", FOOTER])
