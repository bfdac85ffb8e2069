"""Which keys the user set: the input of the rule that refuses a key with no effect (launcher/rules_effect.py).

The composed config does not remember where a value came from, so the launcher composes it a second
time with the overrides that choose profiles (`model=qwen2-7b`, `spec=ngram`, `+tuned=study`,
`hydra/sweeper=tune`) and without those that set keys (`spec.num_tokens=3`, `device=cpu`); a key whose
value differs between the two is one the user changed. So:

- a profile's own values never count: a profile is written for the contexts it is chosen in, and its
  author may set a key for completeness (conf/mode/pd_decode.yaml spells out kv_transfer_port: null);
- an override that repeats the profile's value changes nothing, so it counts neither;
- the overrides of a sweep's job or of a tuning trial are that job's `hydra.overrides.task`, as typed;
- an environment value that a profile interpolates ($LLAUNCH_API_KEY) is in both compositions: not counted.

If the second composition fails (a profile that needs a key's override to compose at all), every key
an override names counts as changed.
"""
from __future__ import annotations

from typing import Any, Iterable

from llaunch.launcher import config_keys

_ABSENT = object()  # a key under an optional group that is not chosen (bench.* without a bench profile)


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _leaf_names() -> set[str]:
    return {k.name for k in config_keys.all_keys()}


def sets_a_key(override: str) -> bool:
    """`spec.num_tokens=3`, `device=cpu`, `~model.tokenizer`: not a profile choice (`spec=ngram`,
    `+tuned=study`, `hydra/sweeper=tune`, `model@x=...`)."""
    key = override_key(override)
    if "/" in key or "@" in key or key.startswith("hydra."):
        return False
    return "." in key or key in _leaf_names()


def choice_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides that choose profiles: the config they compose is what the profiles give."""
    return [o for o in overrides if not sets_a_key(o)]


def schema_key(name: str) -> str:
    """The key of --help an override names: itself, or the dict key it reaches into
    (model.sampling_defaults.temperature → model.sampling_defaults)."""
    leaves = _leaf_names()
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in leaves:
            return ".".join(parts[:end])
    return name


def overridden_keys(overrides: Iterable[str], composed: Any) -> dict[str, Any]:
    """The keys the overrides set, whatever their values (the fallback), with their values in `composed`."""
    keys = {schema_key(override_key(o)) for o in overrides if sets_a_key(o)}
    return {k.name: _value(composed, k.name) for k in config_keys.all_keys() if k.name in keys}


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part, _ABSENT) if cfg is not None else _ABSENT
        if cfg is _ABSENT:
            return _ABSENT
    return cfg


def of_job(composed: Any, hydra_cfg: Any) -> dict[str, Any]:
    """The keys the running Hydra job's overrides changed (`hydra_cfg`: HydraConfig.get())."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(hydra_cfg.overrides.task)
    try:
        baseline = compose(config_name=hydra_cfg.job.config_name, overrides=choice_overrides(overrides))
        return changed_keys(composed, OmegaConf.to_object(baseline))
    except (HydraException, OmegaConfBaseException, ValueError):  # the profiles do not compose without the keys
        return overridden_keys(overrides, composed)  # set (ValueError: no Hydra state in this process)


def changed_keys(composed: Any, baseline: Any) -> dict[str, Any]:
    """The keys of --help whose value in `composed` differs from the one the profiles alone give, with the
    value the user gave (the launcher derives some: a decode instance's router.max_wait_tokens is 0)."""
    return {k.name: _value(composed, k.name) for k in config_keys.all_keys()
            if _value(composed, k.name) != _value(baseline, k.name)}
