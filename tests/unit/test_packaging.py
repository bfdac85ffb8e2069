"""The wheel carries conf/ (the profiles) as package data at llaunch/conf, where launcher/store.py looks
for it in a checkout too; tests/integration/test_wheel.py runs the built wheel outside the checkout."""
from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_conf_folder_ships_in_the_wheel():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["llaunch.conf"] == "conf"
    folders = {".".join(("llaunch", *p.relative_to(REPO).parts)) for p in (REPO / "conf").rglob("*")
               if p.is_dir() and any(p.glob("*.yaml")) or p == REPO / "conf"}
    assert folders - set(setuptools["packages"]) == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "**/*.yaml" in setuptools["package-data"]["llaunch.conf"]


def test_without_the_tune_extra_hydras_plugin_scan_stays_quiet():
    """The images install llaunch without [tune]: Hydra imports hydra_plugins.llaunch_tune at every start,
    which warned 'Error importing ... No module named hydra_plugins.hydra_optuna_sweeper' each time."""
    import subprocess
    import sys

    code = ("import sys, warnings\n"
            "sys.modules['hydra_plugins.hydra_optuna_sweeper'] = None  # as if Optuna's sweeper were not installed\n"
            "warnings.simplefilter('error')\n"
            "from hydra.core.plugins import Plugins\n"
            "from hydra.plugins.sweeper import Sweeper\n"
            "names = [p.__name__ for p in Plugins.instance().discover(Sweeper)]\n"
            "assert 'TuneSweeper' not in names, names\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
