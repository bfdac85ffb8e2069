"""A request's structured output as one Constraint: OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` and `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, LightLLM's `guided_json` / `guided_grammar` / `regular_constraint`. At most one per
request; it compiles before anything reaches the engine (runtime/http/constraint_compiles.py), so a
spec the grammar engine refuses, or takes too long over, is a 400 that names the field."""
from __future__ import annotations

import json
from typing import Any, Optional

from llaunch.runtime.http.constraint_compiles import named
from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.ipc.messages import Constraint


def _schema(value: Any, param: str) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"`{param}` is not JSON.", param=param) from None
        except RecursionError:  # JSON text may nest deeper than the body's decoder allows
            raise bad_request(f"`{param}` nests arrays or objects too deeply.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"`{param}` must be a JSON schema object.", param=param)
    try:
        return Constraint("json_schema", json.dumps(value))  # key order kept: properties come in it
    except RecursionError:
        raise bad_request(f"`{param}` nests arrays or objects too deeply.", param=param) from None


def _depth(value: Any) -> int:
    """Nesting of JSON objects and arrays (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((c, level + 1) for c in children)
    return deepest


def _choice(values: list[str], param: str) -> Constraint:
    if not values or not all(isinstance(v, str) and v for v in values):
        raise bad_request(f"`{param}` must be a non-empty list of non-empty strings.", param=param)
    return Constraint("grammar", "root ::= " + " | ".join(json.dumps(v) for v in dict.fromkeys(values)))


def openai_sources(req) -> list[tuple[str, Constraint]]:
    """Every structured-output field the OpenAI-shaped request sets, as (field, constraint)."""
    found: list[tuple[str, Constraint]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(rf)))
    if getattr(req, "structural_tag", None) is not None:
        try:
            tag = json.loads(req.structural_tag)
        except (ValueError, RecursionError):
            raise bad_request("`structural_tag` is not JSON.", param="structural_tag") from None
        if not isinstance(tag, dict):
            raise bad_request("`structural_tag` must be a JSON object.", param="structural_tag")
        found.append(("structural_tag", _structural_tag(tag, "structural_tag")))
    so = req.structured_outputs
    if so is not None:
        for name, value in (("json", so.json), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
            if value is not None:
                found.append((f"structured_outputs.{name}", constraint_from(name, value, f"structured_outputs.{name}")))
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint("json_object")))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, constraint_from(kind, value, name)))
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise bad_request(f"guided_decoding_backend {req.guided_decoding_backend!r} is not served (xgrammar only).",
                          param="guided_decoding_backend")
    return found


def _response_format(rf) -> Constraint:
    """OpenAI's json_object / json_schema, vLLM's structural_tag, TGI's json / regex / json_schema
    (whose grammar is in `value`)."""
    param = "response_format"
    if rf.type in ("json", "json_object") and rf.value is not None:  # TGI: the schema in `value`
        return _schema(rf.value, "response_format.value")
    if rf.type == "json_object":
        return Constraint("json_object")
    if rf.type == "json_schema" and rf.json_schema is None and isinstance(rf.value, dict):  # TGI: {name, schema}
        return _schema(rf.value.get("schema"), "response_format.value.schema")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema.",
                              param="response_format.json_schema")
        return _schema(rf.json_schema.schema, "response_format.json_schema.schema")
    if rf.type == "regex":
        return constraint_from("regex", rf.value, "response_format.value")
    if rf.type == "structural_tag":
        return _structural_tag({"structures": rf.structures, "triggers": rf.triggers, "format": rf.format}, param)
    raise bad_request(f"response_format.type {rf.type!r} is not one of text, json_object, json_schema, "
                      "structural_tag (vLLM), json or regex (TGI).", param="response_format.type")


def _structural_tag(tag: dict, param: str) -> Constraint:
    """vLLM's structural tag: {structures: [{begin, schema, end}], triggers} (each structure's JSON
    may follow the text once one of the triggers begins it), or xgrammar's {format: ...}."""
    if tag.get("format") is not None:
        return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": tag["format"]}))
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise bad_request(f"`{param}` needs `structures` ([{{begin, schema, end}}]) and `triggers`.", param=param)
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not isinstance(item.get("begin"), str) or not isinstance(item.get("end"), str):
            raise bad_request(f"`{param}.structures[{i}]` needs `begin`, `schema` and `end`.",
                              param=f"{param}.structures[{i}]")
        schema = json.loads(_schema(item.get("schema") or {}, f"{param}.structures[{i}].schema").spec)
        tags.append({"type": "tag", "begin": item["begin"], "end": item["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    if not all(isinstance(t, str) and t for t in triggers):
        raise bad_request(f"`{param}.triggers` must be non-empty strings.", param=f"{param}.triggers")
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}}))


def constraint_from(kind: str, value: Any, param: str) -> Constraint:
    """One field's constraint: kind json (a schema), choice, regex or grammar."""
    if kind == "json":
        return _schema(value, param)
    if kind == "choice":
        return _choice(value, param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"`{param}` must be a non-empty string.", param=param)
    return Constraint("regex" if kind == "regex" else "grammar", value)


def one_constraint(sources: list[tuple[str, Constraint]], limits) -> Optional[Constraint]:
    """The request's one constraint, within `limits`' size and depth, named by its field: it compiles
    before it reaches the engine (runtime/http/constraint_compiles.py), a bad spec being a 400."""
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise bad_request(f"Give one structured output, not several ({names}).", param=sources[1][0])
    param, constraint = sources[0]
    if len(constraint.spec) > limits.max_constraint_chars:
        raise bad_request(f"`{param}` is {len(constraint.spec)} characters as compiled; at most "
                          f"{limits.max_constraint_chars} (server.max_constraint_chars).", param=param)
    if constraint.kind == "json_schema" and _depth(json.loads(constraint.spec)) > limits.max_constraint_depth:
        raise bad_request(f"`{param}` nests objects and arrays more than {limits.max_constraint_depth} deep "
                          "(server.max_constraint_depth).", param=param)
    named(constraint, param)
    return constraint
