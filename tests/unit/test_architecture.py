"""The layout's rules, checked on the source: arrows go launcher → runtime → kernels, no import
cycle among files, the launcher never imports torch, and no behaviour is read from LLAUNCH_*
environment variables (a switch is a config key, so a run's config.yaml reproduces it)."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "runtime", "kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["llaunch", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The llaunch modules `path` imports anywhere in it (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def test_arrows_go_launcher_runtime_kernels():
    wrong = sorted(f"{src} imports {dst}" for src, dsts in _graph().items() for dst in dsts
                   if (src.startswith(("llaunch.runtime", "llaunch.kernels")) and dst.startswith("llaunch.launcher"))
                   or (src.startswith("llaunch.kernels") and dst.startswith("llaunch.runtime")))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_among_files():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dst in sorted(graph[node]):
            if state.get(dst) == 1:
                cycles.append(" → ".join(stack[stack.index(dst):] + [dst]))
            elif dst not in state:
                visit(dst, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_cycle_and_a_wrong_arrow(tmp_path, monkeypatch):
    """The two checks above on a made-up tree: a cycle and a runtime → launcher arrow are found."""
    for pkg, files in {"launcher": {"a.py": "from llaunch.runtime import b\n"},
                       "runtime": {"b.py": "def f():\n    from llaunch.runtime.c import x\n",
                                   "c.py": "from llaunch.runtime import b\nimport llaunch.launcher.a\n"},
                       "kernels": {}}.items():
        (tmp_path / pkg).mkdir()
        for name, text in files.items():
            (tmp_path / pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    graph = _graph()
    assert graph["llaunch.runtime.b"] == {"llaunch.runtime.c"}
    assert graph["llaunch.runtime.c"] == {"llaunch.runtime.b", "llaunch.launcher.a"}
    for check in (test_arrows_go_launcher_runtime_kernels, test_no_import_cycle_among_files):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed what it checks")


def test_the_launcher_never_imports_torch():
    """Planning, rules, dry runs and --help stay fast: importing every launcher module loads no torch."""
    names = sorted(n for n in _modules() if n.startswith("llaunch.launcher"))
    code = ("import importlib, json, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'triton')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def _llaunch_variables(path: Path) -> list[tuple[int, str]]:
    """String constants that name an LLAUNCH_* environment variable, with their lines."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"LLAUNCH_[A-Z0-9_]+", node.value)]


# What the environment may still carry: where models live (Hydra interpolates it: `${models_dir:}`)
# and the API key (a secret, never in a config file; conf/server/default.yaml interpolates it too).
ALLOWED_VARIABLES = {"LLAUNCH_MODELS_DIR", "LLAUNCH_API_KEY"}


def test_no_behaviour_from_llaunch_environment_variables():
    """No code names an LLAUNCH_* variable but the allowed ones, so none is read, however indirectly
    (a constant, a helper)."""
    found = [f"{path.relative_to(REPO)}:{line}: {name}"
             for pattern in ("launcher/**/*.py", "runtime/**/*.py", "kernels/**/*.py", "scripts/**/*.py")
             for path in REPO.glob(pattern) for line, name in _llaunch_variables(path)
             if name not in ALLOWED_VARIABLES]
    assert not found, "\n".join(found)


def test_the_variable_finder_sees_indirect_reads(tmp_path):
    code = tmp_path / "m.py"
    code.write_text('"""Mentions LLAUNCH_GEMV in prose."""\nENV = "LLAUNCH_STEP_TRACE"\nos.getenv(ENV)\n')
    assert _llaunch_variables(code) == [(2, "LLAUNCH_STEP_TRACE")]


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages by hand (the folders map into one `llaunch` namespace): a
    folder missing there imports from the checkout but not from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {_module_name(p) for pkg in PACKAGES for p in (REPO / pkg).rglob("__init__.py")}
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_checkout_root_shadows_no_installed_package():
    """`python -m pytest` or `python -m llaunch...` from the checkout's root puts the root first on sys.path.
    transformers >= 5.25 depends on the PyPI package `kernels` and imports it; were kernels/ a regular package,
    the root's folder would be imported in its place and every transformers model import would fail."""
    probe = ("import importlib.util, json; s = importlib.util.find_spec('kernels'); "
             "print(json.dumps(s and s.origin)); import transformers.activations")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    origin = json.loads(run.stdout.splitlines()[0])
    assert origin is None or not Path(origin).resolve().is_relative_to(REPO / "kernels"), origin
