"""A request body decoded into its msgspec type by every llaunch HTTP app: strict (unknown fields
refused, or dropped and named under server.unknown_fields=warn: runtime/web/unknown_fields.py), and
every failure a 400 naming the field it is about."""
from __future__ import annotations

from typing import Optional, Type, TypeVar

import msgspec

from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.web.unknown_fields import collecting_unknown, decode_without_unknown, unknown_field

R = TypeVar("R")


def decode_body(body: bytes, request_type: Type[R], where: str = "") -> R:
    """`where`: the JSON path of a part of the request decoded on its own (`tools[2]`), which the
    errors and the ignored fields are named under."""
    if not body:
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        try:
            return msgspec.json.decode(body, type=request_type)
        except msgspec.ValidationError as e:
            served = decode_without_unknown(body, request_type, e, where)  # server.unknown_fields=warn
            if served is None:
                raise
            return served
    except msgspec.ValidationError as e:
        hint = " (server.unknown_fields=reject)" if unknown_field(e) is not None and not collecting_unknown() else ""
        param = _param_of(str(e))
        if where:
            param = f"{where}.{param}" if param else where
        raise bad_request(f"Invalid request{f' ({where})' if where else ''}: {e}{hint}", param=param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"The body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("The request body nests arrays or objects too deeply.") from None


def _param_of(message: str) -> Optional[str]:
    """The field a msgspec error names: "... - at `$.messages[0].role`", "missing required field `x`",
    "Object contains unknown field `x`"."""
    path = message.rsplit("at `$.", 1)[1].split("`", 1)[0] if "at `$." in message else None
    for marker in ("required field `", "unknown field `"):
        if marker in message:
            name = message.split(marker, 1)[1].split("`", 1)[0]
            return f"{path}.{name}" if path else name
    return path
