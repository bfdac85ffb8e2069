"""The wheel carries conf/ (the profiles) as package data at llaunch/conf, where launcher/store.py looks
for it in a checkout too; tests/integration/test_wheel.py runs the built wheel outside the checkout."""
from __future__ import annotations

import tomllib
from pathlib import Path

from llaunch.launcher import store

REPO = Path(__file__).resolve().parents[2]


def test_every_conf_folder_ships_in_the_wheel():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["llaunch.conf"] == "conf"
    folders = {".".join(("llaunch", *p.relative_to(REPO).parts)) for p in (REPO / "conf").rglob("*")
               if p.is_dir() and any(p.glob("*.yaml")) or p == REPO / "conf"}
    assert folders - set(setuptools["packages"]) == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "**/*.yaml" in setuptools["package-data"]["llaunch.conf"]


def test_the_profiles_are_found_beside_the_launcher_package():
    """A checkout: <repo>/launcher and <repo>/conf; a wheel: site-packages/llaunch/{launcher,conf}."""
    assert store.CONF_DIR == Path(store.__file__).resolve().parent.parent / "conf"
    assert (store.CONF_DIR / "config.yaml").is_file()
