"""The worker's side of the grammar gate (runtime/router/grammar_gate.py): PrepareConstraints starts
compiles on the GrammarCompiler's pool; the serve loop polls them between steps and reports each
finished one (ConstraintsReady), so the router only plans requests whose grammar is compiled here.
The compiler itself is made off the loop too, on the first constraint: it loads the tokenizer
(importing transformers), which held every stream of the worker for seconds when done inline."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from llaunch.runtime.ipc.messages import Constraint, ConstraintsReady, PrepareConstraints


class ConstraintPrep:
    def __init__(self, compiler: Optional[Callable]):
        """`compiler`: returns the worker's GrammarCompiler (made on first use), or None."""
        self._compiler = compiler
        self._made: Optional[Future] = None  # the compiler, being made on a thread of its own
        self._waiting: list[Constraint] = []  # asked for before the compiler was made
        self._pending: list[tuple[Constraint, Future]] = []

    @property
    def pending(self) -> bool:
        return bool(self._pending or self._waiting)

    def start(self, msg: PrepareConstraints) -> Optional[ConstraintsReady]:
        """Start compiling; without a compiler every constraint fails at once (the report)."""
        if self._compiler is None:
            return ConstraintsReady(constraints=msg.constraints,
                                    errors=["structured output needs the worker's tokenizer"] * len(msg.constraints))
        if self._made is None:
            self._made = ThreadPoolExecutor(1, thread_name_prefix="grammar-setup").submit(self._compiler)
        self._waiting += msg.constraints
        return self._start_waiting()

    def _start_waiting(self) -> Optional[ConstraintsReady]:
        """Hand the waiting constraints to the compiler once it is made (or fail them if it cannot be)."""
        if not self._waiting or not self._made.done():
            return None
        waiting, self._waiting = self._waiting, []
        if self._made.exception() is not None:
            error = f"structured output is unavailable: {self._made.exception()}"
            return ConstraintsReady(constraints=waiting, errors=[error] * len(waiting))
        compiler = self._made.result()
        self._pending += [(c, compiler.compile_async(c)) for c in waiting]
        return None

    def poll(self) -> Optional[ConstraintsReady]:
        """The constraints whose compile ended since the last poll, or None."""
        failed = self._start_waiting()
        if failed is not None:
            return failed
        done = [(c, f) for c, f in self._pending if f.done()]
        if not done:
            return None
        self._pending = [(c, f) for c, f in self._pending if not f.done() or (c, f) not in done]
        errors = [None if f.exception() is None else str(f.exception()) for _, f in done]
        return ConstraintsReady(constraints=[c for c, _ in done], errors=errors)
