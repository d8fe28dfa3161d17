"""The incremental tool-call scanner (services/gateway/call_scanner.py): fed in random pieces it yields each
call's name once, then argument fragments whose concatenation equals the arguments of the whole text scanned
at once, for vLLM's required array, Hermes blocks and Llama 3 JSON; calls cut short keep what was written."""
from __future__ import annotations

import json
import random

import pytest

from services.gateway.call_scanner import CallScanner, scan_calls

CASES = [
    ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "n": [1, {"a": "}"}]}}, {"name":"f","parameters":{}}]',
     1, [("get_weather", '{"city": "Pa\\"ris}", "n": [1, {"a": "}"}]}'), ("f", "{}")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"x": 1}, "name": "g"}\n</tool_call>', 0,
     [("get_weather", '{"city": "Paris"}'), ("g", '{"x": 1}')]),
    ('{"name": "f", "parameters": "str,}"}; {"name": "g", "parameters": 42}', 0, [("f", '"str,}"'), ("g", "42")]),
    ('[{"name": "get_weather", "parameters": {"city": "Pa', 1, [("get_weather", '{"city": "Pa')]),
    ('[{"name": "get_wea', 1, []),
    # Mistral: the marker's own brackets balance, the calls sit in the array after it.
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, "]"]}}, {"name": "g", "arguments": {}}]', 1,
     [("f", '{"a": [1, "]"]}'), ("g", "{}")]),
]


@pytest.mark.parametrize("text,depth,want", CASES)
def test_pieces_add_up_to_the_whole(text, depth, want) -> None:  # noqa: ANN001
    whole = scan_calls(text, depth)
    assert [(c.name, c.arguments) for c in whole if c.name] == want
    for c in whole:
        if c.complete:
            json.loads(c.arguments)
    for seed in range(30):
        rnd = random.Random(seed)
        scanner, got, i = CallScanner(depth), {}, 0
        while i < len(text):
            k = rnd.randint(1, 9)
            for d in scanner.feed(text[i:i + k]):
                slot = got.setdefault(d.index, [None, ""])
                if d.name is not None:
                    assert slot[0] is None, "a call's name comes once"
                    slot[0] = d.name
                else:
                    assert slot[0] is not None, "arguments only after the name"
                slot[1] += d.arguments
            i += k
        assert [tuple(got[k]) for k in sorted(got)] == want


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "qwen3_coder", "pythonic"])
def test_a_tool_stream_in_pieces_equals_the_one_shot_parse(parser: str) -> None:
    """Through ToolStream (content before the calls, the marker held back while it may still be forming)."""
    from services.gateway.schemas import Tool
    from services.gateway.tools import PARSERS, ToolPlan, ToolStream

    body = {"hermes": 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                      '<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>',
            "mistral": 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "x"}}]',
            "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}',
            "qwen3_coder": 'Sure. <tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>\n'
                           '<tool_call>\n<function=g>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>',
            "pythonic": ' [f(a=1), g(b="x")]'}[parser]
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}}}}}),
             Tool.model_validate({"type": "function", "function": {"name": "g"}})]
    plan = ToolPlan("auto", tools, parser=PARSERS[parser](tools))
    content, calls = plan.parse(body)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": "x"}')]
    for seed in range(20):
        rnd, stream, got, text, i = random.Random(seed), ToolStream(plan), {}, "", 0
        while i < len(body):
            k = rnd.randint(1, 7)
            piece, deltas = stream.feed_calls(body[i:i + k])
            text, i = text + piece, i + k
            for d in deltas:
                got.setdefault(d.index, ["", ""])
                got[d.index][0] += d.name or ""
                got[d.index][1] += d.arguments
        text += stream.finish_calls()
        assert text.strip() == (content or "") and [tuple(v) for _, v in sorted(got.items())] == [
            (c.name, c.arguments) for c in calls]
