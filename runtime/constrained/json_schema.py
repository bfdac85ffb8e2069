"""The JSON Schema keywords the grammar cannot enforce. xgrammar compiles a schema that uses them
without a word, then lets through output that breaks them (`not`, `if`, `uniqueItems`, an `allOf`
of several) or refuses output that keeps them (`contains`, `patternProperties`); a request with one
gets a 400 naming each, as a JSON pointer, instead of output that does not validate.
tests/unit/test_constrained.py checks each entry against xgrammar itself.

A `$ref` outside the schema (a URL, another file) is refused too: it is never fetched.

`oneOf` is served as `anyOf` (output matches at least one branch; the branches of the schemas
clients send are disjoint in practice) and an unknown `format` is an annotation, as the spec says."""
from __future__ import annotations

from typing import Any

UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "dependentRequired", "contains", "minContains",
              "maxContains", "patternProperties", "propertyNames")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")  # name → subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def unenforced_keywords(schema: Any, path: str = "") -> list[str]:
    """JSON pointers of the keywords in `schema` the grammar would not enforce."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}/{key}" for key in UNENFORCED if key in schema]
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):  # never fetched: xgrammar takes any value there
        found.append(f"{path}/$ref")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"{path}/allOf")  # only its first schema is applied
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unenforced_keywords(sub, f"{path}/{key}/{_escape(name)}")
    for key in _SCHEMA_LISTS + _SCHEMAS:
        value = schema.get(key)
        subs = value if isinstance(value, list) else [value]
        for i, sub in enumerate(subs):
            found += unenforced_keywords(sub, f"{path}/{key}/{i}" if isinstance(value, list) else f"{path}/{key}")
    return found


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")  # JSON pointer escaping (RFC 6901)
