"""runtime/'s folders are process rooms or shared floors (#42). A room is the code of one process kind;
a floor is code any process may import. A room imports only floors (and itself), a floor imports only
floors: so no process carries another's code, and a floor can be read without knowing any process.
Checked on the source with ast (nothing is imported), every import in a module, function-level ones too."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ROOMS = {
    "http": "the frontend (one module per API dialect)",
    "router": "the router",
    "detokenizer": "the detokenizer",
    "worker": "a worker rank",
    "encoder": "an encoder server (a model's image or audio tower)",
    "kv_host": "the host KV tier's process",
    "pd_master": "the PD master and the config server",
}
FLOORS = {
    "ipc": "messages and sockets between processes, PD wire types",
    "web": "HTTP plumbing of every llaunch HTTP app: errors, guards, lifecycle, SSE, registrar, serving",
    "models": "model families, checkpoint reading, weights, towers",
    "cache": "KV allocation, prefix tree, host pool, embed cache",
    "constrained": "grammar compiling and token masks",
    "kv_transfer": "the KV data plane between PD instances",
}  # and every module directly in runtime/ (config.py, bootstrap.py, ...)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["llaunch", *parts])


def _place(module: str, folders: set[str]) -> str:
    """The room or floor a llaunch.runtime module lives in: its folder under runtime/ (the folder's
    package included), "" for a module directly in runtime/ (a floor)."""
    top = module.split(".")[2]
    return top if top in folders else ""


def _imports(path: Path, name: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every llaunch.runtime module `path` imports; `from pkg import module` counts
    as importing the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return [(line, m) for line, m in dict.fromkeys(found) if m.startswith("llaunch.runtime.") and m != name]


def wrong_imports(repo: Path = REPO) -> list[str]:
    """Each import that crosses from a room into another room, or from a floor into a room; and each
    folder of runtime/ that is neither."""
    runtime = repo / "runtime"
    modules = {_module_name(p, repo): p for p in sorted(runtime.rglob("*.py"))}
    folders = {p.relative_to(runtime).parts[0] for p in modules.values() if p.parent != runtime}
    unplaced = sorted(folders - set(ROOMS) - set(FLOORS))
    wrong = [f"runtime/{f}/ is neither a process room nor a shared floor: add it to ROOMS or FLOORS" for f in unplaced]
    for name, path in modules.items():
        src = _place(name, folders) if name != "llaunch.runtime" else ""
        for line, target in _imports(path, name, set(modules)):
            dst = _place(target, folders)
            if dst in ROOMS and dst != src:
                kind = (f"room {src}" if src in ROOMS else f"floor {src or 'runtime/'}" if src in FLOORS or not src
                        else f"unplaced {src}")
                wrong.append(f"{path.relative_to(repo)}:{line} ({kind}) imports {target} (room {dst})")
    return wrong


def test_rooms_import_only_floors():
    wrong = wrong_imports()
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_each_wrong_import(tmp_path, monkeypatch):
    """On a made-up tree: room → other room and floor → room are found, with their lines; room → own
    room, room → floor, floor → floor and a module of runtime/ itself pass; an unknown folder is named."""
    files = {
        "runtime/__init__.py": "",
        "runtime/bootstrap.py": "from llaunch.runtime.ipc import messages\n",
        "runtime/ipc/messages.py": "import os\n",
        "runtime/router/process.py": "from llaunch.runtime import bootstrap\nfrom llaunch.runtime.router import gate\n",
        "runtime/router/gate.py": "from llaunch.runtime.ipc.messages import X\n",
        "runtime/pd_master/app.py": "def f():\n    from llaunch.runtime.http.errors import ApiError\n",
        "runtime/pd_master/relay.py": "from llaunch.runtime import http\n",
        "runtime/http/__init__.py": "",
        "runtime/http/errors.py": "from .. import bootstrap\n",
        "runtime/cache/pool.py": "from ..detokenizer import process\n",
        "runtime/detokenizer/process.py": "",
        "runtime/mystery/thing.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert wrong_imports(tmp_path) == [
        "runtime/mystery/ is neither a process room nor a shared floor: add it to ROOMS or FLOORS",
        "runtime/cache/pool.py:1 (floor cache) imports llaunch.runtime.detokenizer.process (room detokenizer)",
        "runtime/pd_master/app.py:2 (room pd_master) imports llaunch.runtime.http.errors (room http)",
        "runtime/pd_master/relay.py:1 (room pd_master) imports llaunch.runtime.http (room http)",
    ]
