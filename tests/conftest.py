"""Fixtures shared by every test folder: llaunch's Hydra composition, in-process; kernel settings."""
from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from llaunch.launcher import store


# pyproject's `timeout` (120 s) is for tests that start nothing; these kinds get more unless they name their own.
LONGER_TIMEOUTS = {"slow": 900, "gpu": 600}  # process graphs on 2 busy cores; Triton's first compiles on a GPU


@pytest.hookimpl(trylast=True)  # after the folders' hooks, which mark their items slow
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            longest = max((s for mark, s in LONGER_TIMEOUTS.items() if item.get_closest_marker(mark)), default=None)
            if longest is not None:
                item.add_marker(pytest.mark.timeout(longest))


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
