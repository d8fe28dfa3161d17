"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder` parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one newline after the opening tag and one before the closing tag are layout),
typed by the tool's JSON schema as vLLM types them: strings stay text, integers and numbers become numbers,
booleans `true`/`false`, objects and arrays JSON (or a Python literal), `null` is null for any type, and a
value that does not convert stays text. The arguments are the JSON object of the parameters in the order
written.

`scan_xml_calls` reads the calls in a text that may stop anywhere: a parameter counts once it is closed
(its `</parameter>`, or the next `<parameter=` / `</function>` when a model leaves it open), so each call's
arguments grow only by appending (`{`, then `"key": value` pieces, then `}` at `</function>`), which is what
lets them stream as fragments whose concatenation is the final arguments.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from services.gateway.call_scanner import ScannedCall

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
OBJECT_TYPES = ("object", "array", "arr")


def typed_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for (vLLM's conversions)."""
    if raw.lower() == "null":
        return None
    if schema is None:  # a parameter the tool does not declare: its text
        return raw
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, dict) else "string"
    if kind in STRING_TYPES:
        return raw
    if kind.startswith(INT_PREFIXES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            f = float(raw)
        except ValueError:
            return raw
        if f != f or f in (float("inf"), float("-inf")):
            return raw  # not a JSON number
        return int(f) if f == int(f) else f
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if kind in OBJECT_TYPES or kind.startswith(("dict", "list")):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    try:
        value = ast.literal_eval(raw)  # literals only: nothing is executed
        return json.loads(json.dumps(value, allow_nan=False))  # as JSON has it (tuples are lists)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def _strip_layout(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _next_param_end(body: str, start: int) -> tuple[int, int] | None:
    """Where the value starting at `start` ends: (end of value, where scanning resumes); None: not yet known."""
    ends = [(i, i + len(PARAMETER_END)) for i in [body.find(PARAMETER_END, start)] if i >= 0]
    ends += [(i, i) for i in (body.find(PARAMETER, start), body.find(FUNCTION_END, start)) if i >= 0]
    return min(ends) if ends else None


def scan_xml_calls(text: str, schemas: dict[str, dict[str, Any]]) -> list[ScannedCall]:
    """The calls in `text` (from where they begin), as far as they are settled; `schemas`: each tool's
    parameters schema, by name."""
    calls: list[ScannedCall] = []
    pos = 0
    while True:
        at = text.find(FUNCTION, pos)
        if at < 0:
            return calls
        name_end = text.find(">", at)
        if name_end < 0:
            return calls
        call = ScannedCall(name=text[at + len(FUNCTION):name_end].strip())
        calls.append(call)
        props = (schemas.get(call.name) or {}).get("properties") or {}
        pieces: list[str] = []
        seen: set[str] = set()
        i = name_end + 1
        while True:
            p = text.find(PARAMETER, i)
            f = text.find(FUNCTION_END, i)
            if f >= 0 and (p < 0 or f < p):  # the function closes
                call.arguments, call.complete = "{" + ", ".join(pieces) + "}", True
                pos = f + len(FUNCTION_END)
                break
            if p < 0:
                call.arguments = "{" + ", ".join(pieces) if pieces else ""
                return calls
            key_end = text.find(">", p)
            end = _next_param_end(text, key_end + 1) if key_end >= 0 else None
            if end is None:
                call.arguments = "{" + ", ".join(pieces) if pieces else ""
                return calls
            key = text[p + len(PARAMETER):key_end].strip()
            if key not in seen:  # a repeated parameter keeps its first value (arguments only grow)
                seen.add(key)
                value = typed_value(_strip_layout(text[key_end + 1:end[0]]), props.get(key) if props else None)
                pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            i = end[1]
