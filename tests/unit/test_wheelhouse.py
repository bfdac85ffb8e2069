"""scripts/build_wheelhouse.py: the house it builds installs as the GPU host installs it (pip --no-index
--no-deps --target, PYTHONPATH) and, beside the image's packages only, everything the GPU run imports
from it imports. Built for this interpreter's Python from PyPI (~18 MB), so the check runs here."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_wheelhouse.py"
# What the GPU run imports from the wheelhouse: llaunch's runtime (launcher, runtime, kernels), tests/gpu
# and the integration and fixture modules they import (integration/server.py, test_images.py,
# test_prompt_cache.py: openai), and tuning sweeps (hydra/sweeper=tune).
GPU_RUN_IMPORTS = [
    "hydra", "hydra.core.config_store", "hydra.core.override_parser.overrides_parser", "hydra.plugins.sweeper",
    "omegaconf", "zmq", "zmq.asyncio", "zmq.utils.monitor", "msgspec", "quart", "hypercorn.asyncio",
    "hypercorn.config", "gguf", "xgrammar", "soundfile", "openai", "openai.types.chat", "optuna",
    "hydra_plugins.hydra_optuna_sweeper._impl",
]
# Run with -S (no site-packages) beside the installed house and the image's packages only.
PROBE = """
import importlib, site, sys
house, image, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(1, house)  # PYTHONPATH: before the stdlib and the image's site-packages
site.addsitedir(image)  # the image's site-packages, with its .pth files
bad = []
for m in modules:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {type(e).__name__}: {e}")
try:  # the tests make clients, which load the HTTP stack lazily
    import openai
    openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9"), openai.AsyncOpenAI(api_key="x")
except Exception as e:
    bad.append(f"openai client: {type(e).__name__}: {e}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""
# The GPU suite's collection beside the house and the image only (and llaunch, editable): a GPU test that
# imports a CPU-only test extra (anthropic, schemathesis, ...) fails here, not on the device.
COLLECT = """
import site, sys
sys.path.insert(1, sys.argv[1])
site.addsitedir(sys.argv[2])
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "tests/kernels", "tests/gpu", "-p", "no:cacheprovider"]))
"""


@pytest.fixture(scope="module")
def wheelhouse():
    spec = importlib.util.spec_from_file_location("build_wheelhouse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def house(tmp_path_factory):
    """The wheelhouse for this interpreter's Python, built by the script's command line."""
    out = tmp_path_factory.mktemp("whl")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--python-version", version],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def image_site(image: dict[str, str], into: Path) -> Path:
    """The GPU image's site-packages, as far as this venv holds it: links to the entries of the installed
    distributions the image has, and nothing else (not the venv's copy of what the house ships)."""
    into.mkdir()
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in image or dist.files is None:
            continue
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            source, link = Path(dist.locate_file(top)), into / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    return into


@pytest.mark.slow  # downloads ~18 MB from PyPI and runs pip: ~45 s cold on 2 cores
def test_the_house_installs_offline_and_what_the_gpu_run_imports_imports(house, wheelhouse, tmp_path):
    wheels = sorted(house.glob("*.whl"))
    names = [canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels]
    assert len(names) == len(set(names)), f"two versions of one package break --no-deps: {names}"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, wheels)], check=True)
    image = image_site(wheelhouse.IMAGE, tmp_path / "image")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run = subprocess.run([sys.executable, "-S", "-c", PROBE, str(site), str(image), *GPU_RUN_IMPORTS],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"imports failing from the wheelhouse:\n{run.stdout}{run.stderr[-3000:]}"
    with_llaunch = image_site({**wheelhouse.IMAGE, "llaunch": ""}, tmp_path / "image+llaunch")
    run = subprocess.run([sys.executable, "-S", "-c", COLLECT, str(site), str(with_llaunch)], cwd=REPO,
                         env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert run.returncode == 0, f"the GPU suite does not collect from the wheelhouse:\n{run.stdout[-3000:]}{run.stderr[-2000:]}"


def test_markers_and_extras_are_read_for_the_target(wheelhouse):
    env = wheelhouse.target_env("3.12")
    w = wheelhouse.Wheel(Path("x.whl"), "httpx2", Version("2.16.2"), tuple(map(Requirement, [
        "typing-extensions>=4.5.0; python_version < '3.13'", "httpx2-jsfetch; sys_platform == 'emscripten'",
        "h2<5,>=3; extra == 'http2'", "socksio==1.*; extra == 'socks'"])))
    asked = lambda root: {r.name for r, _ in wheelhouse.active_requirements([Requirement(root)], {"httpx2": w}, env)}
    assert asked("httpx2") == {"httpx2", "typing-extensions"}
    assert asked("httpx2[http2]") == {"httpx2", "typing-extensions", "h2"}
    assert not wheelhouse.active_requirements([Requirement("pywin32; sys_platform == 'win32'")], {}, env)


def test_what_the_image_lacks_or_has_too_old_is_fetched_and_its_cuda_stack_never_is(wheelhouse):
    def need(*reqs):
        asks = {}
        for r in map(Requirement, reqs):
            asks.setdefault(canonicalize_name(r.name), []).append((r, "llaunch"))
        return {n: str(s) for n, s in wheelhouse.missing(asks, {}).items()}

    anyio = wheelhouse.IMAGE["anyio"]
    assert need("anyio>=4", "msgspec") == {"msgspec": ""}
    assert need(f"anyio>{anyio}", "anyio<5") == {"anyio": f"<5,>{anyio}"}
    with pytest.raises(wheelhouse.ClosureError, match=r"torch .*torch>=99"):
        need("torch>=99")


def test_a_call_that_runs_no_tuning_sweep_or_no_test_leaves_their_roots_out(wheelhouse):
    names = lambda *without: {canonicalize_name(r.name) for r in wheelhouse.roots(False, without)}  # noqa: E731
    whole, serve = names(), names("tune", "test")
    assert {"optuna", "hydra-optuna-sweeper", "openai", "pytest"} <= whole
    assert not {"optuna", "hydra-optuna-sweeper", "openai", "pytest"} & serve
    assert {"hydra-core", "quart", "pyzmq", "gguf"} <= serve
    assert names("tune") == whole - {"optuna", "hydra-optuna-sweeper", "sqlalchemy", "alembic"}
