"""The model's Hugging Face tokenizer, for every process that needs one (frontend, detokenizer, and
the worker for structured output): `model.tokenizer`, else `model.path`, a folder or a .gguf file
(transformers reads the tokenizer a GGUF embeds)."""
from __future__ import annotations

import os
from typing import Any

from llaunch.runtime.config import ModelConfig


def load_tokenizer(model: ModelConfig) -> Any:
    from transformers import AutoTokenizer  # slow import: only in the processes that need it

    source = model.tokenizer or model.path
    if source is None:
        raise SystemExit("a tokenizer is needed: set model.tokenizer or model.path")
    if source.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(source) or ".", gguf_file=os.path.basename(source))
    return AutoTokenizer.from_pretrained(source)
