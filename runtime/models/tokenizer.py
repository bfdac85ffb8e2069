"""The model's Hugging Face tokenizer, for every process that needs one (frontend, detokenizer, and
the worker for structured output): `model.tokenizer`, else `model.path`, a folder or a .gguf file
(transformers reads the tokenizer a GGUF embeds)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from llaunch.runtime.config import ModelConfig


def load_tokenizer(model: ModelConfig) -> Any:
    from transformers import AutoTokenizer  # slow import: only in the processes that need it

    source = model.tokenizer or model.path
    if source is None:
        raise SystemExit("a tokenizer is needed: set model.tokenizer or model.path")
    if source.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(source) or ".", gguf_file=os.path.basename(source))
    return AutoTokenizer.from_pretrained(source)


def vocab_ids(folder: str, tokens: list[str]) -> Optional[list[Optional[int]]]:
    """The ids of vocabulary entries as transformers' convert_tokens_to_ids finds them (added tokens first),
    read from the folder's tokenizer.json without loading a tokenizer (the launcher); None when it has none,
    and None for a token it lacks."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    added = {t["content"]: t["id"] for t in data.get("added_tokens") or []}
    return [added.get(t, vocab.get(t)) for t in tokens]
