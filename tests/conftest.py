"""Fixtures shared by every test folder: llaunch's Hydra composition, in-process."""
from __future__ import annotations

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
