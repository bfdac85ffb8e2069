"""Fixtures shared by the unit tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    """scripts/bench_serving.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def workload(bench):
    """scripts/bench_workload.py (prompts, stream timing, metrics), as bench_serving imported it."""
    return sys.modules["bench_workload"]


@pytest.fixture(scope="module")
def scripted_server():
    """The real frontend app on a free port with a scripted engine behind it (unit/scripted_frontend.py)."""
    from unit.http_support import smollm2_tokenizer
    from unit.scripted_frontend import Server

    server = Server(smollm2_tokenizer())
    yield server
    server.stop()
