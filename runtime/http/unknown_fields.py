"""Request fields that no API llaunch speaks (OpenAI, vLLM, TGI, LightLLM) defines: server.unknown_fields.

`warn` (vLLM's behaviour) serves the request without them and names them, as JSON paths, in a log line
and the X-Ignored-Fields response header; `reject` answers a 400 naming the first. Every request
struct forbids unknown fields, so decoding is strict and fast; only a body that has such a field is
decoded again, without it. The fields one HTTP request dropped are collected in a context variable
that the app sets before the route runs (parsing runs in a worker thread, which shares the list).
"""
from __future__ import annotations

import contextvars
import re
from typing import Any, Optional, Type, TypeVar

import msgspec

IGNORED_HEADER = "X-Ignored-Fields"
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$(.*)`)?")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")

R = TypeVar("R")
_ignored: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar("ignored_fields", default=None)


def begin_request(warn: bool) -> None:
    """Before a route: `warn` collects the unknown fields of this request; otherwise they are refused."""
    _ignored.set([] if warn else None)


def collecting_unknown() -> bool:
    """server.unknown_fields=warn is in force for this request."""
    return _ignored.get() is not None


def ignored_fields() -> list[str]:
    return list(_ignored.get() or [])


def unknown_field(error: msgspec.ValidationError) -> Optional[tuple[str, list]]:
    """(the field's name, the path of the object holding it) of an unknown-field error, else None."""
    m = _UNKNOWN.search(str(error))
    if m is None:
        return None
    path = m.group(2) or ""
    steps = [int(i) if i else name for name, i in _STEP.findall(path)]
    if "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in steps) != path:
        return None  # a path through a dict's values ($.d[...]): not one this can follow
    return m.group(1), steps


def decode_without_unknown(body: bytes, request_type: Type[R], first: msgspec.ValidationError) -> Optional[R]:
    """The request decoded without the unknown fields it has (each recorded for the response), or None
    when unknown fields are refused or one cannot be removed (the caller answers `first` as a 400)."""
    ignored = _ignored.get()
    if ignored is None or unknown_field(first) is None:
        return None
    data: Any = msgspec.json.decode(body)
    dropped: list[str] = []
    while True:
        try:
            value = msgspec.convert(data, request_type)
        except msgspec.ValidationError as e:
            found = unknown_field(e)
            if found is None:
                raise
            name, steps = found
            holder = data
            for step in steps:
                holder = holder[step]
            del holder[name]
            dropped.append("".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in [*steps, name]).lstrip("."))
            continue
        ignored.extend(dropped)
        return value
