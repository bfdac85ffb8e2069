"""Kernel tests: every Triton kernel against its torch reference.

On CPU the kernels run under the Triton interpreter (small shapes, fp32/fp16); the interpreter is
chosen when triton is imported, so the variable is set before anything imports it. On a GPU run
with TRITON_INTERPRET=0: the `gpu` tests then use real shapes in bf16 and the interpreter tests skip.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
HAS_GPU = torch.cuda.is_available() and not INTERPRETED

# (atol, rtol) per dtype: what rounding the inputs/outputs to that dtype allows, nothing more.
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@contextlib.contextmanager
def poisoned_allocations():
    """Every tensor a wrapper allocates starts as NaN (floats) or -1 (ints), so an element the
    kernel forgets to write, or a scratch value it reads before writing, fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1) if t.dtype != torch.bool else t

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@pytest.fixture
def ops():
    """The Triton implementations, called directly on CPU tensors under the interpreter."""
    if not INTERPRETED:
        pytest.skip("interpreter tests need TRITON_INTERPRET=1")
    from llaunch.kernels.dispatch import triton_ops

    return triton_ops()


@pytest.fixture
def cuda():
    if not HAS_GPU:
        pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0")
    return torch.device("cuda")


def capture_graph(fn, with_pdl: bool):
    """(graph, fn's output as captured): fn run eagerly, once on a side stream, then captured in a CUDA graph (with
    PDL as the decode graphs launch, where with_pdl), as the worker captures its steps."""
    from llaunch.kernels import pdl

    fn()
    with pdl.for_graphs() if with_pdl else contextlib.nullcontext():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    return graph, out


@pytest.fixture
def captured():
    """capture_graph, for the GPU tests that replay kernels as the decode graphs do."""
    return capture_graph


@pytest.fixture
def close():
    return assert_close


@pytest.fixture
def poisoned():
    return poisoned_allocations


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def build_kv_cache(lengths, kv_heads: int, head_dim: int, dtype, device="cpu"):
    """Random K/V caches whose token slots are a random permutation, for sequences of `lengths`.
    Returns (k_cache, v_cache, req_to_slots, rows): rows[i] (rows shuffled) holds sequence i's
    slots. Every slot no sequence owns, and every unused req_to_slots entry, points at NaN K/V, so a
    kernel that reads past a sequence's length fails."""
    lengths = [int(n) for n in lengths]
    num_slots = sum(lengths) + 7
    k_cache = torch.randn(num_slots, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, device=device).to(dtype)
    perm = torch.randperm(num_slots, device=device)
    poison_slot = int(perm[-1])
    k_cache[perm[sum(lengths):]] = float("nan")
    v_cache[perm[sum(lengths):]] = float("nan")
    max_rows, max_len = len(lengths) + 2, max(lengths) + 9
    req_to_slots = torch.full((max_rows, max_len), poison_slot, dtype=torch.int32, device=device)
    rows = torch.randperm(max_rows, device=device)[: len(lengths)]
    taken = 0
    for row, n in zip(rows.tolist(), lengths):
        req_to_slots[row, :n] = perm[taken : taken + n].to(torch.int32)
        taken += n
    return k_cache, v_cache, req_to_slots, rows


@pytest.fixture
def kv_cache():
    return build_kv_cache


def _compile_for_sm90(code: str) -> dict:
    """Run `code` (which compiles kernels with triton.compile for an sm90 target and prints one JSON
    line last) in a subprocess without the interpreter: GPU builds, checked on a machine without one."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def sm90_compile():
    """_compile_for_sm90, for the tests that read GPU builds (PTX, shared memory) without a GPU."""
    return _compile_for_sm90
