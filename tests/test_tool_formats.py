"""Qwen3-Coder's XML tool calls and pythonic call lists (services/gateway/xml_calls.py, pythonic_calls.py): values
typed by the tools' schemas as vLLM's qwen3_coder parser types them, Python literals read with ast (never
evaluated), text that is not a call list left as content, and streaming in random pieces adding up to the
one-shot parse; the formats chosen from the chat template. The end-to-end tests through a real mesh are in
tests/test_tool_formats_mesh.py."""
from __future__ import annotations

import json
import random

import pytest

from services.gateway.call_scanner import SettledScanner
from services.gateway.pythonic_calls import NotCalls, scan_pythonic_calls
from services.gateway.schemas import Tool
from services.gateway.tools import PARSERS, PythonicParser, Qwen3CoderParser, parser_for_template
from services.gateway.xml_calls import scan_xml_calls, typed_value

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "exact": {"type": "boolean"},
    "tags": {"type": "array"}, "opts": {"type": "object"}, "note": {}}}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}})]


@pytest.mark.parametrize("raw,schema,want", [
    ("Paris", {"type": "string"}, "Paris"), ("12", {"type": "string"}, "12"), ("12", {"type": "integer"}, 12),
    ("twelve", {"type": "integer"}, "twelve"), ("2.5", {"type": "number"}, 2.5), ("3.0", {"type": "number"}, 3),
    ("inf", {"type": "number"}, "inf"), ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, False),
    ('[1, "a"]', {"type": "array"}, [1, "a"]), ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
    ("null", {"type": "integer"}, None), ("NULL", {"type": "string"}, None), ("x", None, "x"),
    ("__import__('os').getcwd()", {"type": "object"}, "__import__('os').getcwd()"),
    ("7", {"description": "no type: a string"}, "7"),
])
def test_xml_values_are_typed_by_the_schema(raw, schema, want) -> None:  # noqa: ANN001
    assert typed_value(raw, schema) == want and type(typed_value(raw, schema)) is type(want)


XML = ('I will check.\n<tool_call>\n<function=forecast>\n<parameter=city>\nNew\nYork\n</parameter>\n'
       '<parameter=days>\n3\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=exact>\nfalse\n'
       '</parameter>\n<parameter=other>\n<b>\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=forecast>\n'
       '<parameter=temp>\n-1.5\n<parameter=city>\nOslo</function>\n</tool_call>')


def test_xml_calls_parse_with_types_and_content_before() -> None:
    content, calls = Qwen3CoderParser(TOOLS).parse(XML)
    assert content == "I will check."
    assert [c.name for c in calls] == ["forecast", "forecast"]
    assert json.loads(calls[0].arguments) == {"city": "New\nYork", "days": 3, "tags": ["a", "b"], "exact": False,
                                              "other": "<b>"}
    # Unclosed parameters end at the next parameter or at </function> (vLLM's rule).
    assert json.loads(calls[1].arguments) == {"temp": -1.5, "city": "Oslo"}
    assert calls[0].arguments == json.dumps(json.loads(calls[0].arguments), ensure_ascii=False)
    # No call at all, or one never closed: the text stays content.
    assert Qwen3CoderParser(TOOLS).parse("plain <function") == ("plain <function", [])
    cut = "<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n</parameter>\n"
    assert Qwen3CoderParser(TOOLS).parse(cut) == (cut, [])
    (partial,) = scan_xml_calls(cut, {"forecast": SCHEMA})
    assert (partial.name, partial.arguments, partial.complete) == ("forecast", '{"city": "Paris"', False)


PYTHONIC = '[forecast(city="Par\\"is, (x)", days=3, tags=[1, -2.5, None, True], opts={"a": (1, "]")}), noop()]'


def test_pythonic_calls_are_literals_read_with_ast() -> None:
    content, calls = PythonicParser(TOOLS).parse(PYTHONIC)
    assert content is None and [c.name for c in calls] == ["forecast", "noop"]
    assert json.loads(calls[0].arguments) == {"city": 'Par"is, (x)', "days": 3, "tags": [1, -2.5, None, True],
                                              "opts": {"a": [1, "]"]}}
    assert calls[1].arguments == "{}"
    wrapped = "<|python_start|>[f(a='''x\ny''')]<|python_end|>"
    assert [(c.name, json.loads(c.arguments)) for c in PythonicParser().parse(wrapped)[1]] == [("f", {"a": "x\ny"})]


@pytest.mark.parametrize("text", [
    "[1, 2]", "[f(1)]", "[f(a=b)]", "[f(a=__import__('os').system('true'))]", "[f(a=1) + 1]", "[f(a=1)] and more",
    "[]", "[f(a=1, a=2)]", "[f(a=1e999)]", "[f(a={1: 2})]", "[f(a=1)", "Sure: [f(a=1)]", "[f(a=f'{x}')]",
])
def test_what_is_not_a_literal_call_list_stays_content(text: str) -> None:
    assert PythonicParser().parse(text) == (text, [])


@pytest.mark.parametrize("text,scan", [
    (XML[XML.index("<tool_call>"):], lambda t: scan_xml_calls(t, {"forecast": SCHEMA})),
    (PYTHONIC, lambda t: scan_pythonic_calls(t)[0]),
    (PYTHONIC[:70], lambda t: scan_pythonic_calls(t)[0]),
])
def test_streamed_pieces_add_up_to_the_whole(text, scan) -> None:  # noqa: ANN001
    want = [(c.name, c.arguments) for c in scan(text)]
    assert want
    for seed in range(30):
        rnd, scanner, got, i = random.Random(seed), SettledScanner(scan), {}, 0
        while i < len(text):
            k = rnd.randint(1, 6)
            for d in scanner.feed(text[i:i + k]):
                if d.name is not None:
                    assert d.index not in got, "a call's name comes once"
                    got[d.index] = [d.name, ""]
                got[d.index][1] += d.arguments
            i += k
        assert [tuple(got[k]) for k in sorted(got)] == want


def test_a_text_that_turns_out_not_to_be_calls_streams_none() -> None:
    scanner = SettledScanner(lambda t: scan_pythonic_calls(t)[0])
    assert scanner.feed("[1") == [] and scanner.failed
    with pytest.raises(NotCalls):
        scan_pythonic_calls("[1")


def test_the_format_follows_the_template_and_the_flag() -> None:
    coder = "{{ '<tool_call>\\n<function=' }}{{ name }}{{ '>\\n<parameter=' }}"
    assert isinstance(parser_for_template(coder), Qwen3CoderParser)
    assert isinstance(parser_for_template("[func_name1(params_name1=params_value1)]"), PythonicParser)
    assert isinstance(parser_for_template("<|python_start|>"), PythonicParser)
    assert isinstance(parser_for_template("<tool_call>", "qwen3_coder"), Qwen3CoderParser)
    assert isinstance(parser_for_template(coder, "pythonic"), PythonicParser)
    assert {"qwen3_coder", "pythonic", "llama4_pythonic", "qwen3_xml", "llama4_json"} <= set(PARSERS)
