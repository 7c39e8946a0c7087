"""Schema-typed tool-call arguments.

Rules (the XML form carries every value as text):
- A parameter whose schema admits a string (``type`` includes ``"string"``, a string
  ``enum``/``const``, any ``anyOf``/``oneOf`` branch admitting a string, or no type
  constraint at all) keeps its text verbatim: ``"02134"`` and ``""`` stay strings.
- Otherwise the text is parsed by the schema's types, tried in a fixed order: null,
  boolean (case-insensitive ``true``/``false``), integer, number, object, array (JSON).
- An empty (whitespace-only) value of a parameter that does not admit a string is
  omitted; a value that fits none of the types is passed through as the string.
- Unknown parameters (and parameters of undeclared tools) are strings.
- JSON form (Hermes): the same typing applies to string values only (``coerce_json_value``);
  an empty string stays (nothing is omitted from arguments the model wrote as JSON).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

OMIT = object()  # sentinel: leave the parameter out of the arguments

_INT_RE = re.compile(r"[+-]?\d+\Z")
_ORDER = ("null", "boolean", "integer", "number", "object", "array")


def _types(schema: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a schema admits; None means unconstrained."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    found: set[str] = set()
    constrained = False
    t = schema.get("type")
    if isinstance(t, str):
        found.add(t)
        constrained = True
    elif isinstance(t, list):
        found.update(x for x in t if isinstance(x, str))
        constrained = True
    for key in ("enum",):
        if isinstance(schema.get(key), list):
            constrained = True
            for v in schema[key]:
                found.add(_json_type(v))
    if "const" in schema:
        constrained = True
        found.add(_json_type(schema["const"]))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            constrained = True
            for b in branches:
                sub = _types(b, depth + 1)
                if sub is None:
                    return None
                found |= sub
    if not constrained:
        if isinstance(schema.get("properties"), dict):
            return {"object"}
        if "items" in schema:
            return {"array"}
        return None
    return found


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def admits_string(schema: Any) -> bool:
    types = _types(schema)
    return types is None or "string" in types


def param_schema(parameters: dict[str, Any] | None, name: str) -> Any:
    """The schema of one parameter, or None when it is not declared."""
    if not isinstance(parameters, dict):
        return None
    props = parameters.get("properties")
    if isinstance(props, dict):
        return props.get(name)
    return None


def is_streamable(schema: Any) -> bool:
    """Whether the value stays a string (so it can be streamed as it arrives)."""
    return schema is None or admits_string(schema)


def coerce_text(text: str, schema: Any) -> Any:
    """Typed value for ``text`` under ``schema``; :data:`OMIT` to leave it out."""
    if is_streamable(schema):
        return text
    types = _types(schema) or set()
    stripped = text.strip()
    if not stripped:
        return OMIT
    for t in _ORDER:
        if t not in types:
            continue
        value = _parse_as(t, stripped)
        if value is not _NO:
            return value
    return text


_NO = object()


def _parse_as(t: str, s: str) -> Any:
    low = s.lower()
    if t == "null":
        return None if low in ("null", "none") else _NO
    if t == "boolean":
        return True if low == "true" else False if low == "false" else _NO
    if t == "integer":
        if _INT_RE.match(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return _NO
        return int(f) if math.isfinite(f) and f.is_integer() else _NO
    if t == "number":
        if _INT_RE.match(s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return _NO
        return f if math.isfinite(f) else _NO
    if t in ("object", "array"):
        try:
            v = json.loads(s)
        except ValueError:
            return _NO
        want = dict if t == "object" else list
        return v if isinstance(v, want) else _NO
    return _NO


def coerce_json_value(value: Any, schema: Any) -> Any:
    """A JSON-form argument typed by its parameter's schema: a string value of a parameter
    that does not admit a string is parsed like an XML value (``"5"`` -> 5, ``"true"`` ->
    True, ``'{"a": 1}'`` -> an object); conservatively: a string that fits none of the
    types, or an empty one, stays as written, and non-string values are never touched."""
    if isinstance(value, str) and schema is not None and not admits_string(schema):
        typed = coerce_text(value, schema)
        return value if typed is OMIT else typed
    return value


def coerce_json_arguments(arguments: dict[str, Any], parameters: dict[str, Any] | None) -> dict[str, Any]:
    """For the JSON form (streamed or not): every value through :func:`coerce_json_value`."""
    return {key: coerce_json_value(value, param_schema(parameters, key)) for key, value in arguments.items()}
