"""Request fields that no API llaunch speaks (OpenAI, vLLM, TGI, LightLLM) defines: server.unknown_fields.

`warn` (vLLM's behaviour) serves the request without them and names them, as JSON paths, in a log line
and the X-Ignored-Fields response header; `reject` answers a 400 naming the first. Every request
struct forbids unknown fields, so decoding is strict and fast; only a body that has such a field is
decoded again, without it. The fields one HTTP request dropped are collected in a context variable
that the app sets before the route runs (parsing runs in a worker thread, which shares the list).
"""
from __future__ import annotations

import contextvars
import json
import re
import types
import typing
from typing import Annotated, Any, Optional, Type, TypeVar, Union

import msgspec

IGNORED_HEADER = "X-Ignored-Fields"
_UNKNOWN = "Object contains unknown field `"
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
MAX_HEADER_CHARS = 2048

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


def unknown_field(error: msgspec.ValidationError) -> Optional[list]:
    """The path (keys and indices) of the object holding an unknown field, from msgspec's "Object
    contains unknown field `NAME`[ - at `$PATH`]", else None. The name is not read from the message
    (msgspec writes it raw, control characters and all): the caller compares the object's keys with
    its struct's fields."""
    message = str(error)
    if not message.startswith(_UNKNOWN):
        return None
    _, at, path = message.rpartition("` - at `$")
    if not at:
        return []
    path = path[:-1]
    steps = [int(i) if i else key for key, i in _STEP.findall(path)]
    if "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in steps) != path:
        return None  # a path through a dict's values ($.d[...]): not one this can follow
    return steps


def _choose(t: Any, value: Any) -> Any:
    """The member of an Optional / Union / Annotated type that `value` (a JSON object or array) decodes as."""
    while True:
        origin = typing.get_origin(t)
        if origin is Annotated:
            t = typing.get_args(t)[0]
        elif origin is Union or origin is types.UnionType:
            kinds = [a for a in typing.get_args(t)
                     if (isinstance(value, dict) and (isinstance(a, type) and issubclass(a, msgspec.Struct)
                                                      or typing.get_origin(a) is dict))
                     or (isinstance(value, list) and typing.get_origin(a) is list)]
            if len(kinds) != 1:
                return None
            t = kinds[0]
        else:
            return t


def _fields_at(request_type: Any, data: Any, steps: list) -> Optional[tuple[Any, set[str]]]:
    """(the object at `steps` in `data`, its struct's field names), or None where that is no struct."""
    t, value = request_type, data
    try:
        for step in steps:
            t = _choose(t, value)
            if isinstance(step, str):
                t = {f.name: f.type for f in msgspec.structs.fields(t)}[step]
            else:
                t = typing.get_args(t)[0]
            value = value[step]
        t = _choose(t, value)
        if not (isinstance(value, dict) and isinstance(t, type) and issubclass(t, msgspec.Struct)):
            return None
        return value, {f.encode_name for f in msgspec.structs.fields(t)}
    except (KeyError, IndexError, TypeError):
        return None


def header_value(fields: list[str]) -> str:
    """The X-Ignored-Fields value: the paths, non-ASCII and control characters escaped (a header is
    ASCII), cut to MAX_HEADER_CHARS."""
    text = ", ".join(json.dumps(f)[1:-1] for f in fields)
    return text if len(text) <= MAX_HEADER_CHARS else text[:MAX_HEADER_CHARS - 3] + "..."


def decode_without_unknown(body: bytes, request_type: Type[R], first: msgspec.ValidationError,
                           where: str = "") -> Optional[R]:
    """The request decoded without the unknown fields it has (each recorded for the response, under
    `where`: the path of a part decoded on its own), or None when unknown fields are refused or one
    cannot be removed (the caller answers `first` as a 400)."""
    ignored = _ignored.get()
    if ignored is None or unknown_field(first) is None:
        return None
    data: Any = msgspec.json.decode(body)
    dropped: list[str] = []
    while True:
        try:
            value = msgspec.convert(data, request_type)
        except msgspec.ValidationError as e:
            steps = unknown_field(e)
            # the path as read, else the top level (a field name may itself hold "` - at `$...")
            for path in ([steps, []] if steps else [steps]):
                found = _fields_at(request_type, data, path) if path is not None else None
                unknown = [key for key in found[0] if key not in found[1]] if found else []
                if unknown:
                    break
            else:
                raise
            holder = found[0]
            prefix = (where + "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in path)).lstrip(".")
            for key in unknown:
                del holder[key]
                dropped.append(f"{prefix}.{key}" if prefix else key)
            continue
        ignored.extend(dropped)
        return value
