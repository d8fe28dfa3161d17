"""Pythonic tool calls (vLLM's `pythonic` / `llama4_pythonic` parsers): the whole answer is a Python list of calls
with keyword arguments, `[get_weather(city="Paris", unit="c"), get_time(zone=1)]` (Llama 3.2/4 may wrap it in
`<|python_start|>...<|python_end|>`). Values are Python literals, read with `ast` and never evaluated; anything
else (a name, an expression, positional arguments) means the text is not a call list and stays content.

`scan_pythonic_calls` reads a text that may stop anywhere: an argument counts once the comma or parenthesis
after it is written (and a call once its first argument does, or it closes), so each call's arguments (the JSON object of its keyword arguments) only grow by
appending and stream as fragments whose concatenation is the final arguments.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from services.gateway.call_scanner import ScannedCall

WRAP_START, WRAP_END = "<|python_start|>", "<|python_end|>"
OPEN = {"(": ")", "[": "]", "{": "}"}


class NotCalls(ValueError):
    """The text is not (the beginning of) a pythonic call list."""


def literal(node: ast.AST) -> Any:
    """A JSON value from a literal's syntax tree."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise NotCalls("not a JSON number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -literal(node.operand) if isinstance(node.op, ast.USub) else literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = literal(k) if k is not None else None
            if not isinstance(key, str):
                raise NotCalls("dictionary keys must be strings")
            out[key] = literal(v)
        return out
    raise NotCalls(f"{type(node).__name__} is not a literal")


def _value(text: str) -> Any:
    try:
        return literal(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise NotCalls(str(e)) from None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _identifier(text: str, i: int) -> tuple[str, int] | None:
    """The identifier at `i` and where it ends; None while it may still be growing (at the text's end)."""
    if not (text[i].isalpha() or text[i] == "_"):
        raise NotCalls(f"{text[i]!r} does not start a name")
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] == "_"):
        j += 1
    if j == len(text):
        return None
    name = text[i:j]
    if not name.isidentifier():
        raise NotCalls(f"{name!r} is not a name")
    return name, j


_SPECIAL = re.compile(r"""['"()\[\]{},]""")  # what matters in a value outside strings
_IN_STRING = {q: re.compile(r"[\\\n" + q + "]") for q in "'\""}  # what matters inside one


def _value_end(text: str, i: int) -> int | None:
    """Where the argument value starting at `i` ends (the comma or parenthesis at depth 0); None: not yet.
    Long values are re-read on every streamed piece: the regexes skip the characters that change nothing."""
    depth: list[str] = []
    j = i
    while True:
        m = _SPECIAL.search(text, j)
        if m is None:
            return None
        j, ch = m.start(), m.group()
        if ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, j) else ch
            if len(text) - j < 3 and text[j:] == ch * (len(text) - j):
                return None  # "" or " at the end: a triple quote may be forming
            k = j + len(quote)
            while True:
                hit = _IN_STRING[ch].search(text, k)
                if hit is None:
                    return None
                k = hit.start()
                if text[k] == "\\":
                    k += 2
                elif text.startswith(quote, k):
                    break
                elif text[k] == "\n" and len(quote) == 1:
                    raise NotCalls("a string runs past the end of its line")
                else:
                    k += 1
            j = k + len(quote)
            continue
        if ch in OPEN:
            depth.append(OPEN[ch])
        elif ch in ")]}":
            if not depth:
                if ch != ")":
                    raise NotCalls(f"unexpected {ch!r}")
                return j
            if depth.pop() != ch:
                raise NotCalls(f"unbalanced {ch!r}")
        elif not depth:  # a comma
            return j
        j += 1


def scan_pythonic_calls(text: str) -> tuple[list[ScannedCall], bool]:
    """(the calls as far as they are settled, whether the list is closed); NotCalls when `text` is not a call
    list (the calls begin at text[0], after any whitespace)."""
    i = _skip_space(text, 0)
    if text.startswith(WRAP_START, i):
        i = _skip_space(text, i + len(WRAP_START))
    if i >= len(text):
        return [], False
    if text[i] != "[":
        raise NotCalls("a call list starts with [")
    calls: list[ScannedCall] = []
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return calls, False
        if text[i] == "]" and not calls:
            raise NotCalls("an empty list calls nothing")
        got = _identifier(text, i)
        if got is None:
            return calls, False
        name, i = got
        i = _skip_space(text, i)
        if i >= len(text):
            return calls, False
        if text[i] != "(":
            raise NotCalls(f"{name} is not called")
        # Announced once its first argument is read (or it closes): `[print(open(x))]` is never a call.
        call = ScannedCall(name=name)
        pieces: list[str] = []
        seen: set[str] = set()
        i += 1
        while True:  # keyword arguments
            i = _skip_space(text, i)
            if i >= len(text):
                return calls, False
            if text[i] == ")":
                break
            got = _identifier(text, i)
            if got is None:
                return calls, False
            key, i = got
            i = _skip_space(text, i)
            if i >= len(text):
                return calls, False
            if text[i] != "=" or text.startswith("==", i):
                raise NotCalls(f"argument {key} of {name} is not a keyword argument")
            end = _value_end(text, i + 1)
            if end is None:
                return calls, False
            if key in seen:
                raise NotCalls(f"argument {key} of {name} is repeated")
            seen.add(key)
            pieces.append(f"{json.dumps(key)}: {json.dumps(_value(text[i + 1:end]), ensure_ascii=False)}")
            call.arguments = "{" + ", ".join(pieces)
            if len(pieces) == 1:
                calls.append(call)
            i = end + 1 if text[end] == "," else end
        call.arguments, call.complete = "{" + ", ".join(pieces) + "}", True
        if not pieces:
            calls.append(call)
        i = _skip_space(text, i + 1)
        if i >= len(text):
            return calls, False
        if text[i] == "]":
            rest = text[i + 1:].strip()
            if rest and rest != WRAP_END and not WRAP_END.startswith(rest):
                raise NotCalls("text after the call list")
            return calls, True
        if text[i] != ",":
            raise NotCalls("calls are separated by commas")
        i += 1
