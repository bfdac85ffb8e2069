"""Constraints compiled by xgrammar for one tokenizer: JSON schema, any JSON object, regex, EBNF
grammar, structural tag (tool calls). A spec compiles once per process (cached by its text) and off
the caller's thread when asked for asynchronously; a spec xgrammar refuses raises ConstraintError
with its message, which the frontend answers with a 400."""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from llaunch.runtime.constrained.json_schema import unenforced_keywords
from llaunch.runtime.ipc.messages import Constraint

KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20
_CACHE_ENTRIES = 512


class ConstraintError(ValueError):
    """The constraint cannot be compiled (bad schema, regex or grammar)."""


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, with a cache of compiled specs and a small thread pool."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, threads: int = 2, info_json: Optional[str] = None):
        """`info_json`: the TokenizerInfo another compiler serialized (`info.serialize_json()`), instead
        of reading `hf_tokenizer` (which may then be None)."""
        import xgrammar as xgr

        self._xgr = xgr
        self.info = (xgr.TokenizerInfo.deserialize_json(info_json) if info_json is not None
                     else xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True,
                                             cache_limit_bytes=256 << 20)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._futures: dict[Constraint, Future] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint):
        """The compiled grammar (blocking); ConstraintError when it cannot be built."""
        return self.compile_async(constraint).result()

    def compile_async(self, constraint: Constraint) -> Future:
        with self._lock:
            future = self._futures.get(constraint)
            if future is None:
                if len(self._futures) >= _CACHE_ENTRIES:  # oldest out (xgrammar caches compiled bytes too)
                    self._futures.pop(next(iter(self._futures)))
                future = self._futures[constraint] = self._pool.submit(self._compile, constraint)
            return future

    def _compile(self, c: Constraint):
        if c.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {c.kind!r} (one of {', '.join(KINDS)})")
        if len(c.spec) > MAX_SPEC_CHARS:
            raise ConstraintError(f"the {c.kind} has {len(c.spec)} characters; at most {MAX_SPEC_CHARS}")
        comp = self._compiler
        if c.kind == "json_schema":
            _check_schema(c.spec)
        try:
            if c.kind == "json_schema":
                compiled = comp.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            elif c.kind == "json_object":  # an object, as OpenAI's json_object means (the builtin grammar takes any value)
                compiled = comp.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif c.kind == "regex":
                compiled = comp.compile_regex(c.spec)
            elif c.kind == "grammar":
                compiled = comp.compile_grammar(c.spec)
            else:
                compiled = comp.compile_structural_tag(json.loads(c.spec))
        except ConstraintError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own errors on bad specs
            raise ConstraintError(f"the {c.kind.replace('_', ' ')} cannot be used: {str(e).strip()[:500]}") from None
        self._check_matches_something(compiled, c.kind)
        return compiled

    def _check_matches_something(self, compiled, kind: str) -> None:
        """xgrammar compiles a spec no text can match (`[^\\s\\S]`, a rule that only refers to itself);
        its first mask allows nothing and the sampler would draw from all -inf logits."""
        mask = self._xgr.allocate_token_bitmask(1, self.info.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not bool(mask.any()):
            raise ConstraintError(f"the {kind.replace('_', ' ')} matches no text")


def _check_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
        unenforced = unenforced_keywords(schema)
    except ValueError:
        raise ConstraintError("the JSON schema is not JSON") from None
    except RecursionError:
        raise ConstraintError("the JSON schema nests too deeply") from None
    if unenforced:
        raise ConstraintError(f"the JSON schema uses keywords structured output cannot enforce: "
                              f"{', '.join(unenforced[:20])}")
