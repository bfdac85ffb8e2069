"""Fixtures shared by every test folder: llaunch's Hydra composition, in-process; kernel settings."""
from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from llaunch.launcher import store


@pytest.fixture
def compose_config():
    """`compose_config(*overrides, conf_dir=None) -> LlaunchConfig`, composed as `llaunch` does."""
    store.register()

    def run(*overrides: str, conf_dir=store.CONF_DIR):
        GlobalHydra.instance().clear()  # Hydra keeps global state between compositions
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))

    yield run
    GlobalHydra.instance().clear()


@pytest.fixture
def kernel_settings():
    """`kernel_settings(**changes)` applies kernels/settings.py values (as a worker's `kernels` config
    would) for the rest of the test; the defaults come back after it."""
    from llaunch.kernels import settings

    before = settings.current.settings

    def apply(**changes):
        settings.configure(dataclasses.replace(before, **changes))

    yield apply
    settings.configure(before)
