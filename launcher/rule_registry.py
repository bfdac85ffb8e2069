"""The machinery of the start-up rules (launcher/rules.py holds the rules themselves): a rule is a
registered check that yields (keys, message) pairs; `check_all`, `warnings` and `pending` run the
registry for a resolved config, so a bad config lists every problem at once. The registry is filled
when launcher/rules.py is imported: use the functions through that module.

A rule registered with `changes=True` also gets the keys the user changed from what the profiles
give, with the values given (launcher/config_changes.py); without them (a config built in a test) it
sees none changed."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from llaunch.runtime.config import LlaunchConfig


@dataclass(frozen=True)
class Violation:
    rule: str
    keys: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class Pending:
    """A rule that did not run: a value it needs is unknown yet, or it checks this machine in a dry run."""

    rule: str
    keys: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[LlaunchConfig], list[Violation]]
    needs: tuple[str, ...]  # dotted keys that must be known (not None) for the check to mean anything
    live: str  # "": always; "skip": checks this machine, skipped by a dry run; "warn": a dry run warns
    changes: bool = False  # the check takes (cfg, changed keys) instead of (cfg)


RULES: list[Rule] = []
NOTHING_CHANGED: Mapping[str, Any] = MappingProxyType({})


def get(cfg: LlaunchConfig, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _missing(cfg: LlaunchConfig, keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if get(cfg, k) is None]


def rule(needs: tuple[str, ...] = (), live: str = "", changes: bool = False):
    """Register a check; it returns (keys, message) pairs, which become Violations named after it.
    changes=True: the check is called with the keys the user changed too."""

    def register(fn: Callable[..., list[tuple[tuple[str, ...], str]]]):
        @functools.wraps(fn)
        def check(cfg: LlaunchConfig, changed: Mapping[str, Any] = NOTHING_CHANGED) -> list[Violation]:
            if _missing(cfg, needs):
                return []
            found = fn(cfg, changed) if changes else fn(cfg)
            return [Violation(fn.__name__, tuple(keys), message) for keys, message in found]

        RULES.append(Rule(fn.__name__, check, needs, live, changes))
        return check

    return register


def check_all(cfg: LlaunchConfig, changed: Mapping[str, Any] = NOTHING_CHANGED) -> list[Violation]:
    """Every violation; a dry run skips the rules about this machine (it plans for another one).
    `changed`: the keys the user set away from the profiles' values, with those values
    (launcher/config_changes.py)."""
    return [v for r in RULES if not (cfg.dry_run and r.live) for v in r.check(cfg, changed)]


def warnings(cfg: LlaunchConfig) -> list[Violation]:
    """In a dry run, what a real start would refuse here (a missing checkpoint, say): reported, not fatal."""
    return [v for r in RULES if cfg.dry_run and r.live == "warn" for v in r.check(cfg)]


def pending(cfg: LlaunchConfig) -> list[Pending]:
    out = []
    for r in RULES:
        if cfg.dry_run and r.live == "skip":
            out.append(Pending(r.name, r.needs, "checks this machine; skipped by a dry run"))
        elif missing := _missing(cfg, r.needs):
            out.append(Pending(r.name, tuple(missing), "waits for model.path (or a sized profile)"
                               if any(k.startswith("model.") for k in missing) else "waits for a value"))
    return out
