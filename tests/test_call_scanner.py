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
