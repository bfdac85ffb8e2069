"""The router's grammar gate: requests wait outside the scheduler until every rank compiled their
constraint; one prepare per constraint; failures end the held requests; aborts reach held ones."""
from llaunch.runtime.ipc.messages import AddRequest, Constraint, ConstraintsReady, SamplingParams
from llaunch.runtime.router.grammar_gate import READY_ENTRIES, GrammarGate
from llaunch.runtime.router.request import Request

SCHEMA = Constraint(kind="json_schema", spec='{"type": "object"}')
REGEX = Constraint(kind="regex", spec="a+")


def req(rid: str, constraint=None) -> Request:
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=[1, 2], arrival_time=0.0,
                     sampling=SamplingParams(max_new_tokens=4, constraint=constraint))
    return Request(msg, msg.sampling)


def test_requests_wait_until_every_rank_compiled_their_grammar():
    gate = GrammarGate(ranks=2)
    assert not gate.hold(req("plain"))
    a, b, c = req("a", SCHEMA), req("b", SCHEMA), req("c", REGEX)
    assert gate.hold(a) and gate.hold(b) and gate.hold(c)
    assert gate.to_prepare == [SCHEMA, REGEX] and len(gate) == 3  # one prepare per constraint
    assert gate.on_ready(ConstraintsReady(constraints=[SCHEMA], errors=[None])) == ([], [])  # rank 0 only
    assert gate.on_ready(ConstraintsReady(constraints=[SCHEMA, REGEX], errors=[None, "bad regex"])) == ([a, b], [])
    released, failed = gate.on_ready(ConstraintsReady(constraints=[REGEX], errors=[None]))
    assert released == [] and failed == [(c, "bad regex")]  # one rank's failure fails it
    assert not gate.hold(req("d", SCHEMA)) and len(gate) == 0  # compiled: straight to the scheduler


def test_aborts_reach_held_requests_and_ready_constraints_are_bounded():
    gate = GrammarGate(ranks=1)
    a = req("a", SCHEMA)
    gate.hold(a)
    assert gate.abort("a") is a and gate.abort("a") is None and len(gate) == 0
    for i in range(READY_ENTRIES + 1):
        c = Constraint(kind="regex", spec=f"x{i}")
        gate.hold(req(f"r{i}", c))
        gate.on_ready(ConstraintsReady(constraints=[c], errors=[None]))
    assert gate.hold(req("old", Constraint(kind="regex", spec="x0")))  # the oldest was forgotten: prepared again
    assert not gate.hold(req("new", Constraint(kind="regex", spec=f"x{READY_ENTRIES}")))


def _ready_within(prep, seconds: float = 30.0):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        report = prep.poll()
        if report is not None:
            return report
        time.sleep(0.01)
    raise AssertionError("no ConstraintsReady")


def test_the_workers_compiler_is_made_off_the_step_loop():
    """The first constraint makes the compiler (it loads the tokenizer): start() and poll() return while
    it is being made, and the constraint compiles once it is; a compiler that cannot be made fails
    the constraints instead of the worker."""
    import threading
    from concurrent.futures import Future

    from llaunch.runtime.ipc.messages import PrepareConstraints
    from llaunch.runtime.worker.constraint_prep import ConstraintPrep

    class Compiler:
        def compile_async(self, constraint):
            done = Future()
            done.set_result(constraint)
            return done

    release = threading.Event()
    prep = ConstraintPrep(lambda: release.wait(60) and Compiler())
    assert prep.start(PrepareConstraints(constraints=[SCHEMA])) is None
    assert prep.pending and prep.poll() is None  # still making the compiler: the loop goes on
    release.set()
    assert _ready_within(prep) == ConstraintsReady(constraints=[SCHEMA], errors=[None])
    assert not prep.pending

    def broken():
        raise OSError("no tokenizer at /nowhere")

    prep = ConstraintPrep(broken)
    report = prep.start(PrepareConstraints(constraints=[SCHEMA, REGEX])) or _ready_within(prep)
    assert report.constraints == [SCHEMA, REGEX] and all("no tokenizer" in e for e in report.errors)
