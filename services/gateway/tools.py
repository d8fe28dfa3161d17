"""Tool calling: the request's rules, the constraint that enforces `required` and a named tool_choice,
and the parsers that find tool calls in a model's own text (for `auto`), chosen by the chat template.

- `required` / a named function: the output is constrained (structured outputs) to a JSON array of
  {"name", "parameters"} objects (vLLM's shape) / to the named function's parameters, so the calls
  always parse and match the schemas.
- `auto`: the model decides; its text is parsed in the format its chat template teaches: Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2/Qwen3, and the demo template) or
  Llama 3.x's JSON form (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`) or Mistral's
  `[TOOL_CALLS][...]` or Qwen3-Coder's XML `<tool_call><function=...><parameter=...>` (xml_calls.py) or a
  pythonic call list `[f(a=1)]` (pythonic_calls.py); the gateway's --tool-call-parser overrides the choice.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.call_scanner import CallDelta, CallScanner, SettledScanner, scan_calls
from services.gateway.pythonic_calls import WRAP_START, NotCalls, scan_pythonic_calls
from services.gateway.xml_calls import FUNCTION, scan_xml_calls
from services.gateway.errors import bad_request
from services.gateway.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from shared.sampling_params import StructuredOutput


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolParser:
    """Finds tool calls in generated text; `start` marks where calls begin, for streaming."""

    start: str = ""
    depth: int = 0  # where call objects sit in the text (call_scanner.py)

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        # Each tool's parameters schema, by name: formats that write values as text are typed by it.
        self.schemas: dict[str, dict[str, Any]] = {t.function.name: t.function.parameters or {} for t in tools}

    def scanner(self) -> CallScanner | SettledScanner:
        """What streams the calls once they begin."""
        return CallScanner(self.depth)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def begins_calls(self, text: str) -> int | None:
        """Index in `text` where tool calls begin, if they have."""
        i = text.find(self.start)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        """How many trailing characters of `text` could still turn out to be the start of the calls."""
        return _held(text, self.start)


class HermesParser(ToolParser):
    start = "<tool_call>"
    depth = 0

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        begin = text.find(self.start)
        calls = _complete_calls(text[begin:], self.depth) if begin >= 0 else []
        if not calls:
            return text, []
        content = text[:begin].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    start = "<|python_tag|>"
    depth = 0

    def begins_calls(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.start) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or self.start.startswith(stripped) else 0

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.start).strip()
        calls = _complete_calls(body, self.depth) if body.startswith("{") else []
        return (None, calls) if calls else (text, [])


class MistralParser(HermesParser):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: the calls sit in the array after the marker
    (depth 1 counting from the marker, whose own brackets balance)."""

    start = "[TOOL_CALLS]"
    depth = 1


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder's `<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`, values
    typed by the tools' schemas (xml_calls.py). As vLLM, a bare `<function=` without the `<tool_call>` wrapper
    counts too."""

    start = "<tool_call>"
    markers = ("<tool_call>", FUNCTION)

    def begins_calls(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        return max(_held(text, m) for m in self.markers)

    def scanner(self) -> SettledScanner:
        return SettledScanner(lambda text: scan_xml_calls(text, self.schemas))

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        begin = self.begins_calls(text)
        calls = [ParsedCall(c.name or "", c.arguments) for c in scan_xml_calls(text[begin:], self.schemas)
                 if c.complete] if begin is not None else []
        if not calls:
            return text, []
        return text[:begin].strip() or None, calls


class PythonicParser(ToolParser):
    """A Python list of calls with literal keyword arguments as the whole answer (pythonic_calls.py), optionally
    in Llama 4's `<|python_start|>...<|python_end|>`."""

    start = WRAP_START

    def begins_calls(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.start) or stripped.startswith("["):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or self.start.startswith(stripped) else 0

    def scanner(self) -> SettledScanner:
        return SettledScanner(lambda text: scan_pythonic_calls(text)[0])

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        try:
            calls, closed = scan_pythonic_calls(text)
        except NotCalls:
            return text, []
        if not closed:
            return text, []
        return None, [ParsedCall(c.name or "", c.arguments) for c in calls]


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could still be the start of `marker`."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


# vLLM's --tool-call-parser names for the formats kvmesh reads (llama4_json, qwen3_xml and llama4_pythonic are
# vLLM's other names or parsers for the same formats).
PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                        "llama4_json": Llama3JsonParser,
                                        "mistral": MistralParser, "qwen3_coder": Qwen3CoderParser,
                                        "qwen3_xml": Qwen3CoderParser, "pythonic": PythonicParser,
                                        "llama4_pythonic": PythonicParser}


def _complete_calls(text: str, depth: int) -> list[ParsedCall]:
    """The calls a model wrote of its own accord (auto): only whole objects with a name and JSON arguments."""
    calls = []
    for c in scan_calls(text, depth):
        if c.name is None or not c.complete:
            continue
        try:
            json.loads(c.arguments or "{}")
        except json.JSONDecodeError:
            continue
        calls.append(ParsedCall(c.name, c.arguments or "{}"))
    return calls


def parser_for_template(template: str | None, name: str | None = None, tools: Sequence[Tool] = ()) -> ToolParser | None:
    """The format the chat template teaches, or the one `name` (the gateway's --tool-call-parser) names."""
    if name:
        return PARSERS[name](tools)
    if not template:
        return None
    if FUNCTION in template and "<parameter=" in template:  # before Hermes: Qwen3-Coder wraps calls in <tool_call>
        return Qwen3CoderParser(tools)
    if "<tool_call>" in template:
        return HermesParser(tools)
    if "[TOOL_CALLS]" in template:
        return MistralParser(tools)
    # vLLM's pythonic templates show the form ("[func_name1(params_name1=...), func_name2(params)]"); Llama 4
    # wraps calls in <|python_start|>.
    if "[func_name1(" in template or WRAP_START in template:
        return PythonicParser(tools)
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser(tools)
    return None


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[Tool]
    parallel: bool = True
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto

    @property
    def tools_json(self) -> str:
        return json.dumps([t.model_dump(mode="json") for t in self.tools], ensure_ascii=False)

    def constraint(self) -> StructuredOutput | None:
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutput(kind="json_schema", spec=json.dumps(fn.parameters))
        if self.mode == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                                  "parameters": t.function.parameters},
                                "required": ["name", "parameters"], "additionalProperties": False}
                               for t in self.tools]}
            schema: dict = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput(kind="json_schema", spec=json.dumps(schema))
        return None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The final text of a choice -> (content, calls)."""
        if self.mode == "named":
            # No answer text (a reasoning model cut by max_tokens before it answered): no call, as streamed.
            return None, [ParsedCall(self.name or "", text)] if text else []
        if self.mode == "required":
            # The arguments as written (a constrained array, cut short only by max_tokens): the same text a
            # stream sends (call_scanner.py).
            calls = [ParsedCall(c.name, c.arguments) for c in scan_calls(text, 1) if c.name is not None]
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def plan_tools(body: ChatCompletionRequest, chat_template: str | None, parser_name: str | None = None) -> ToolPlan | None:
    """The request's tool mode, or a 400 for an inconsistent request. None: no tools involved.
    `parser_name`: the gateway's --tool-call-parser, which overrides the format read from the chat template."""
    choice = body.tool_choice
    if not body.tools:
        # As vLLM: any tool_choice but none needs tools.
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools: the request has none", param="tool_choice")
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice == "none":
        return ToolPlan("none", body.tools)
    if (body.response_format is not None and body.response_format.type != "text") or body.structured_outputs:
        if choice is not None and choice != "auto":
            raise bad_request("tool_choice required or a named function cannot be combined with response_format",
                              param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                              param="tool_choice")
        return ToolPlan("named", body.tools, body.parallel_tool_calls, name=choice.function.name)
    if choice == "required":
        return ToolPlan("required", body.tools, body.parallel_tool_calls)
    parser = parser_for_template(chat_template, parser_name, body.tools)
    if parser is None:
        raise bad_request("tool_choice auto needs a chat template with a tool-call format (Hermes <tool_call>, "
                          "Llama 3 JSON, Mistral [TOOL_CALLS], Qwen3-Coder XML or pythonic) or the gateway's "
                          "--tool-call-parser; use tool_choice required or a named function", param="tool_choice")
    return ToolPlan("auto", body.tools, body.parallel_tool_calls, parser=parser)


class ToolStream:
    """One choice's streamed text under a tool plan: content is passed on until tool calls may begin; from there
    the calls are scanned as they form (`feed_calls`: names, then argument fragments), or held back and parsed
    whole at the end (`feed` / `finish`, for formatters that send calls whole)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already passed on as content
        self.holding = plan.mode in ("named", "required")  # constrained output is all calls
        self.calls_from = 0 if self.holding else None  # where the calls begin in text
        self.scanner: CallScanner | SettledScanner | None = CallScanner(1) if plan.mode == "required" else None
        self.streamed: list[str | None] = []  # names of the calls already announced, by index
        self.ids: list[str] = []  # their ids

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        parser = self.plan.parser
        if self.plan.mode != "auto" or parser is None:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        begin = parser.begins_calls(self.text)
        if begin is not None:
            self.holding, self.calls_from = True, begin
            self.scanner = parser.scanner()
            out, self.sent = self.text[self.sent:begin], max(self.sent, begin)
            return out
        end = max(len(self.text) - parser.holdback(self.text), self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def feed_calls(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(content, call deltas) of one piece of text, for streaming calls as they form."""
        already = self.calls_from
        seen = len(self.text)
        content = self.feed(delta)
        if self.plan.mode == "named":
            first = not self.streamed
            if first and not delta:  # announced with its first argument text (none while a model reasons)
                return "", []
            if first:
                self.streamed.append(self.plan.name)
                self.ids.append(_new_id())
            return "", [CallDelta(0, self.plan.name if first else None, delta)] if first or delta else []
        if self.scanner is None:
            return content, []
        # The part of the text the scanner has not seen: from where the calls begin, or from this delta.
        start = self.calls_from if already is None else seen
        deltas = [d for d in self.scanner.feed(self.text[start:]) if self.plan.parallel or d.index == 0]
        for d in deltas:
            if d.name is not None:
                self.streamed.append(d.name)
                self.ids.append(_new_id())
        return content, deltas

    def finish_calls(self) -> str:
        """Content still owed once the choice is over, when `feed_calls` streamed the calls."""
        if self.streamed:
            return ""
        return self.text[self.sent:]  # held text that never became a call is content after all

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, calls) once the choice is over."""
        content, calls = self.plan.parse(self.text)
        if calls:
            rest = (content or "")[self.sent:] if content and len(content) > self.sent else ""
            return rest, calls
        return self.text[self.sent:], []


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
