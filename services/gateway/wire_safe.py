"""Request values that JSON allows but the bus cannot carry: integers beyond 64 bits (msgpack refuses
them when the request is encoded for a worker) and lone UTF-16 surrogates such as "\\ud800" (JSON's
escapes allow them, Python keeps them, and they fail the moment any service encodes the text as UTF-8).

Both used to surface as 500s deep in the request path; checking the raw body once, before any field
is parsed, turns them into 400s that name the field, for every field at once (new fields included).
"""
from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # msgpack's signed range: what every service can decode


def first_unsendable(value: Any, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(field path, problem) for the first value the wire cannot carry, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            return ".".join(path), f"integer out of range (must fit in 64 bits: [{INT_MIN}, {INT_MAX}])"
        return None
    if isinstance(value, str):
        return (".".join(path), "text contains a lone surrogate (not valid Unicode)") if _has_surrogate(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _has_surrogate(k):
                return ".".join((*path, "<key>")), "a key contains a lone surrogate (not valid Unicode)"
            found = first_unsendable(v, (*path, str(k)))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = first_unsendable(v, (*path, str(i)))
            if found:
                return found
    return None


def check_sendable(data: Any) -> Any:
    """A pydantic before-validator: raise the error `validation_error` turns into a 400 naming the field."""
    found = first_unsendable(data)
    if found:
        field, problem = found
        raise PydanticCustomError("unsendable", "{field}: {problem}", {"field": field, "problem": problem})
    return data


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
