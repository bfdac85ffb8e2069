"""Every key of the typed config (runtime/config.py) with its type, default and description, read
from the schema itself (a field's comment is its description): `--help` lists them, and a key that
does not exist is answered with the closest one that does."""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import tokenize
import typing
from enum import Enum
from functools import lru_cache
from typing import Any

from llaunch.runtime.config import LlaunchConfig


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted: router.max_running_requests
    type: str
    default: str
    doc: str


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _optional_inner(tp)
    if isinstance(inner, type) and issubclass(inner, Enum):
        name = "|".join(m.value for m in inner)
    elif typing.get_origin(inner) in (list, dict):
        name = f"{typing.get_origin(inner).__name__}[{', '.join(_type_name(a) for a in typing.get_args(inner))}]"
    else:
        name = getattr(inner, "__name__", str(inner).replace("typing.", ""))
    return f"{name}?" if optional else name  # ?: may be null


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "null"
    return value.value if isinstance(value, Enum) else str(value)


def _comments(cls: type) -> dict[str, str]:
    """Field → description: the comment at the end of its line, after the comment lines above it."""
    source = inspect.getsource(cls)
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    docs, above = {}, []
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(trailing.get(number, ""))
            continue
        name = stripped.split(":", 1)[0]
        if ":" in stripped and name.isidentifier() and not stripped.startswith(("def ", "class ", "return ")):
            docs[name] = " ".join(above + ([trailing[number]] if number in trailing else []))
        above = []
    return docs


@lru_cache(maxsize=None)
def all_keys(cls: type = LlaunchConfig, prefix: str = "") -> tuple[Key, ...]:
    hints, docs = typing.get_type_hints(cls), _comments(cls)
    found: list[Key] = []
    for f in dataclasses.fields(cls):
        inner, _ = _optional_inner(hints[f.name])
        if dataclasses.is_dataclass(inner):
            found += all_keys(inner, f"{prefix}{f.name}.")
        else:
            found.append(Key(prefix + f.name, _type_name(hints[f.name]), _default(f), docs.get(f.name, "")))
    return tuple(found)


def _free_form(name: str) -> bool:
    """Under a dict-typed key (model.rope_scaling.factor) any name goes."""
    return any(name.startswith(k.name + ".") and k.type.startswith("dict") for k in all_keys())


def unknown(name: str) -> bool:
    keys = {k.name for k in all_keys()}
    groups = {k.name.rsplit(".", 1)[0] for k in all_keys() if "." in k.name}
    return name not in keys and name not in groups and not _free_form(name)


def closest(name: str) -> list[str]:
    """The existing keys nearest to a misspelled one (up to two): by the last part within its group,
    then anywhere."""
    group, _, leaf = name.rpartition(".")
    names = [k.name for k in all_keys()] + sorted({k.name.split(".", 1)[0] for k in all_keys()})  # groups too
    for candidates, cutoff in (([n for n in names if n.rpartition(".")[0] == group], 0.6), (names, 0.8)):
        by_leaf = {n.rpartition(".")[2]: n for n in candidates}
        match = difflib.get_close_matches(leaf, list(by_leaf), n=2, cutoff=cutoff)
        if match:
            return [by_leaf[m] for m in match]
    return []


def unknown_key_message(name: str) -> str:
    hints = closest(name)
    if not hints:
        return f"{name} is not a config key; `llaunch --help` lists them."
    return f"{name} is not a config key; did you mean {' or '.join(hints)}?"
