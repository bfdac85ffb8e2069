"""The worker's side of the grammar gate (runtime/router/grammar_gate.py): PrepareConstraints starts
compiles on the GrammarCompiler's pool; the serve loop polls them between steps and reports each
finished one (ConstraintsReady), so the router only plans requests whose grammar is compiled here."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional

from llaunch.runtime.ipc.messages import Constraint, ConstraintsReady, PrepareConstraints


class ConstraintPrep:
    def __init__(self, compiler: Optional[Callable]):
        """`compiler`: returns the worker's GrammarCompiler (made on first use), or None."""
        self._compiler = compiler
        self._pending: list[tuple[Constraint, Future]] = []

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def start(self, msg: PrepareConstraints) -> Optional[ConstraintsReady]:
        """Start compiling; without a compiler every constraint fails at once (the report)."""
        if self._compiler is None:
            return ConstraintsReady(constraints=msg.constraints,
                                    errors=["structured output needs the worker's tokenizer"] * len(msg.constraints))
        compiler = self._compiler()
        self._pending += [(c, compiler.compile_async(c)) for c in msg.constraints]
        return None

    def poll(self) -> Optional[ConstraintsReady]:
        """The constraints whose compile ended since the last poll, or None."""
        done = [(c, f) for c, f in self._pending if f.done()]
        if not done:
            return None
        self._pending = [(c, f) for c, f in self._pending if not f.done() or (c, f) not in done]
        errors = [None if f.exception() is None else str(f.exception()) for _, f in done]
        return ConstraintsReady(constraints=[c for c, _ in done], errors=errors)
