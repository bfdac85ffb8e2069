"""A request's structured output is compiled before it reaches the engine, so a spec the grammar engine
refuses, or one that compiles for longer than server.max_constraint_compile_s, is a 400 naming the
field. The compile runs in runtime/constrained/compile_pool.py's processes, awaited by the event loop
(EngineClient.submit calls `gate`): it never holds a thread of the executor that parses requests.

Parsing names each constraint's field (`named`, from the parse thread) in a per-request dict that the
app opens before the route runs, as runtime/web/unknown_fields.py collects ignored fields."""
from __future__ import annotations

import contextvars
from typing import Optional

from llaunch.runtime.constrained.compile_pool import CompileBusy, CompilePool, CompileTimeout, CompileUnavailable
from llaunch.runtime.web.errors import ApiError, bad_request
from llaunch.runtime.ipc.messages import Constraint

_fields: contextvars.ContextVar[Optional[dict[Constraint, str]]] = contextvars.ContextVar("constraint_fields",
                                                                                         default=None)


def begin_request() -> None:
    _fields.set({})


def named(constraint: Constraint, param: str) -> None:
    """The request field `constraint` came from (a parse thread shares the request's dict)."""
    fields = _fields.get()
    if fields is not None:
        fields.setdefault(constraint, param)


class ConstraintCompiles:
    def __init__(self, pool: CompilePool):
        self.pool = pool

    async def gate(self, constraints: list[Constraint]) -> None:
        """Raise the ApiError of the first constraint that does not compile within the budget."""
        fields = _fields.get() or {}
        for constraint in dict.fromkeys(constraints):
            param = fields.get(constraint)
            field = f"`{param}`" if param else "The structured output"
            try:
                error = await self.pool.check(constraint)
            except CompileTimeout:
                raise bad_request(f"{field} did not compile within {self.pool.budget_s:g} s "
                                  "(server.max_constraint_compile_s): simplify it (a regex's or grammar's compile "
                                  "grows with its alternatives and repetitions).", param=param,
                                  code="constraint_too_complex") from None
            except CompileBusy:
                raise ApiError(503, "The grammar compilers are busy with other requests' structured outputs; "
                                    "retry later.", type="service_unavailable", code="compilers_busy") from None
            except CompileUnavailable as e:
                raise ApiError(503, f"Structured output is unavailable: {e}", type="service_unavailable",
                               code="structured_output_unavailable") from None
            if error is not None:
                raise bad_request(f"{field}: {error}", param=param)
