"""A grammar compile process of runtime/constrained/compile_pool.py: forked from the pool's forkserver
(which preloads this module and xgrammar), it reads the tokenizer, says ready, then compiles one spec
at a time, answering (spec, None) or (spec, why it does not compile). It dies with the forkserver,
which dies with the frontend."""
from __future__ import annotations

from typing import Any, Callable, Optional

from llaunch.runtime.bootstrap import die_with_parent
from llaunch.runtime.constrained.compiler import ConstraintError, GrammarCompiler


def serve_compiles(conn, make_tokenizer: Callable[[], Any], vocab_size: int, info_json: Optional[str]) -> None:
    """`info_json`: the tokenizer's vocabulary as an earlier process serialized it (None: the first
    process loads the tokenizer, which may take seconds for a GGUF, and returns it in its ready message)."""
    die_with_parent()
    try:
        tokenizer = make_tokenizer() if info_json is None else None
        compiler = GrammarCompiler(tokenizer, vocab_size, threads=1, info_json=info_json)
    except Exception as e:  # noqa: BLE001: the pool reports it; structured output is then unavailable
        conn.send(("failed", f"the tokenizer did not load for grammar compiles: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", compiler.info.serialize_json() if info_json is None else None))
    while True:
        try:
            constraint = conn.recv()
        except (EOFError, OSError):  # the pool closed the pipe, or its frontend is gone
            return
        try:
            compiler.compile(constraint)
            error = None
        except ConstraintError as e:
            error = str(e)
        try:
            conn.send(("done", (constraint, error)))
        except OSError:  # the pool ended this process's job meanwhile, or its frontend is gone
            return
