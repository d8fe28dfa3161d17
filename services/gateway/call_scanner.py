"""Tool calls found in a stream of text as they are generated: each call's name as soon as its string is complete,
then its arguments as raw text fragments, so a client sees a call forming (and a call cut by max_tokens still shows
what was generated).

A call is a JSON object {"name": "...", "<args key>": {...}} at a given depth of the text: depth 1 inside vLLM's
`required` array `[{...}, {...}]`, depth 0 for Hermes `<tool_call>{...}</tool_call>` blocks and Llama 3's JSON
form (what surrounds the objects there holds no quotes or braces). The arguments are passed on exactly as written,
so their concatenation is the arguments of the same text scanned whole (`scan_calls`), byte for byte.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ARGS_KEYS = ("arguments", "parameters")


@dataclass
class CallDelta:
    """What one piece of text added to call `index`: its name (once, first), then argument text."""
    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ScannedCall:
    name: str | None = None
    arguments: str = ""  # raw text of the arguments value, as far as it was generated
    complete: bool = False  # its object closed


@dataclass
class _Frame:
    kind: str  # "{" or "["
    key: str | None = None  # the last key read at this object level
    expect_key: bool = True  # in an object: the next string is a key


class CallScanner:
    def __init__(self, depth: int, args_keys: tuple[str, ...] = ARGS_KEYS) -> None:
        self.depth = depth  # where call objects sit
        self.args_keys = args_keys
        self.calls: list[ScannedCall] = []
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escape = False
        self._capture: str | None = None  # reading a "key" or the "name" value at call level
        self._string = ""
        # Reading the arguments value: None, "armed" (after its colon), "container", "string" or "literal".
        self._args: str | None = None
        self._args_base = 0  # stack depth the container value closes back to
        self._out: list[CallDelta] = []

    def feed(self, text: str) -> list[CallDelta]:
        for ch in text:
            self._step(ch)
        out, self._out = _merge(self._out), []
        return out

    # ---- emission

    def _arg(self, ch: str) -> None:
        call = self.calls[-1]
        call.arguments += ch
        if call.name is not None:
            self._out.append(CallDelta(len(self.calls) - 1, arguments=ch))

    def _named(self, name: str) -> None:
        call = self.calls[-1]
        call.name = name
        # Arguments written before the name (a model may order the keys either way) follow the name at once.
        self._out.append(CallDelta(len(self.calls) - 1, name=name, arguments=call.arguments))

    # ---- the state machine

    def _call_level(self) -> bool:
        return len(self._stack) == self.depth + 1 and self._stack[-1].kind == "{"

    def _string_char(self, ch: str) -> bool:
        """Advance inside a string; True when this character closed it."""
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            return True
        return False

    def _step(self, ch: str) -> None:
        if self._args is not None and self._args_step(ch):
            return
        if self._in_string:
            closed = self._string_char(ch)
            if closed:
                self._end_string()
            elif self._capture:
                self._string += ch
            return
        if ch == '"':
            self._in_string = True
            frame = self._stack[-1] if self._stack else None
            self._string = ""
            if self._call_level() and frame.expect_key:
                self._capture = "key"
            elif self._call_level() and frame.key == "name" and self.calls[-1].name is None:
                self._capture = "name"
            else:
                self._capture = None
        elif ch == "{":
            if len(self._stack) == self.depth:
                self.calls.append(ScannedCall())
            self._stack.append(_Frame("{"))
        elif ch == "[":
            self._stack.append(_Frame("["))
        elif ch in "}]":
            if self._stack:
                frame = self._stack.pop()
                if frame.kind == "{" and len(self._stack) == self.depth and self.calls:
                    self.calls[-1].complete = True
        elif ch == ":" and self._call_level():
            frame = self._stack[-1]
            frame.expect_key = False
            if frame.key in self.args_keys:
                self._args = "armed"
        elif ch == "," and self._stack and self._stack[-1].kind == "{":
            self._stack[-1].expect_key = True

    def _args_step(self, ch: str) -> bool:
        """The arguments value; True when `ch` was consumed by it."""
        state = self._args
        if state == "armed":
            if ch.isspace():
                return True
            if ch in "{[":
                self._args, self._args_base = "container", len(self._stack)
                self._stack.append(_Frame(ch))
            elif ch == '"':
                self._args = "string"
            else:
                self._args = "literal"
            self._arg(ch)
            return True
        if state == "literal":
            if ch in ",}" or ch.isspace():
                self._args = None
                return False  # the separator is the call object's
            self._arg(ch)
            return True
        self._arg(ch)
        if state == "string":
            if self._in_string_args(ch):
                self._args = None
            return True
        # a container value
        if self._in_string:
            self._string_char(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._stack.append(_Frame(ch))
        elif ch in "}]":
            self._stack.pop()
            if len(self._stack) == self._args_base:
                self._args = None
        return True

    def _in_string_args(self, ch: str) -> bool:
        """A string value's characters after its opening quote; True at its closing quote."""
        if not self._in_string:
            self._in_string = True  # the opening quote was consumed when armed
        return self._string_char(ch)

    def _end_string(self) -> None:
        frame = self._stack[-1] if self._stack else None
        if self._capture == "key" and frame is not None:
            frame.key = self._string
        elif self._capture == "name":
            self._named(self._string)
        self._capture = None


def _merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive argument pieces of one call become one delta."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and d.name is None and out[-1].index == d.index:
            last = out[-1]
            out[-1] = CallDelta(d.index, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out


def scan_calls(text: str, depth: int, args_keys: tuple[str, ...] = ARGS_KEYS) -> list[ScannedCall]:
    s = CallScanner(depth, args_keys)
    s.feed(text)
    return s.calls


class SettledScanner:
    """Streaming for formats read by re-scanning the whole text (XML, pythonic): `scan(text)` gives each call's
    name and its arguments as far as they are settled (they only grow by appending as the text grows); what
    each feed added is passed on as deltas, like CallScanner's. A scan that raises ValueError means the
    text is not calls after all: nothing more streams."""

    def __init__(self, scan: Callable[[str], list[ScannedCall]]) -> None:
        self._scan = scan
        self._text = ""
        self._sent: list[str] = []  # arguments text streamed, per announced call
        self.calls: list[ScannedCall] = []
        self.failed = False

    def feed(self, text: str) -> list[CallDelta]:
        self._text += text
        if self.failed:
            return []
        try:
            self.calls = self._scan(self._text)
        except ValueError:
            self.failed = True
            return []
        out = []
        for i, c in enumerate(self.calls):
            if i == len(self._sent):
                self._sent.append(c.arguments)
                out.append(CallDelta(i, name=c.name, arguments=c.arguments))
            elif len(c.arguments) > len(self._sent[i]) and c.arguments.startswith(self._sent[i]):
                out.append(CallDelta(i, arguments=c.arguments[len(self._sent[i]):]))
                self._sent[i] = c.arguments
        return out
