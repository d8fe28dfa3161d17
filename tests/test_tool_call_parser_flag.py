"""--tool-call-parser (issue 26): the gateway reads tool calls in the format the flag names instead of the one
its chat template teaches. Mistral's `[TOOL_CALLS][...]` on a real mesh through the openai client, streamed
and not; the model's text is forced by a regex, so it goes through the real engine and gateway."""
from __future__ import annotations

import json

import pytest

from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_tools import ASK, TOOLS, chat

MISTRAL = (r'Ok\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "c"\}\}, '
           r'\{"name": "get_time", "arguments": \{"zone": 2\}\}\]')


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "mistral-tools", "qwen3", checkpoint={"max_position_embeddings": 2048},
                          tool_call_parser="mistral") as m:
        yield openai_client(m)


def test_mistral_calls_parse_and_stream(client) -> None:  # noqa: ANN001
    kw = dict(tool_choice="auto", temperature=1.0, seed=3, extra_body={"structured_outputs": {"regex": MISTRAL}})
    whole = chat(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Ok."
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [n for n, _ in calls] == ["get_weather", "get_time"] and json.loads(calls[1][1]) == {"zone": 2}
    content, got, first = "", {}, {}
    for c in chat(client, stream=True, **kw):
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in got:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                first[tc.index], got[tc.index] = tc.function.name, ""
            got[tc.index] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason
    assert content.strip() == "Ok." and reason == "tool_calls"
    assert [(first[k], got[k]) for k in sorted(got)] == calls
    # The Hermes form the qwen3 template teaches is not read any more: it stays content.
    hermes = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": 1\}\}\n</tool_call>'
    plain = chat(client, tool_choice="auto", temperature=0, extra_body={"structured_outputs": {"regex": hermes}})
    assert plain.choices[0].message.tool_calls == [] and "<tool_call>" in plain.choices[0].message.content


def test_the_flag_names_a_known_parser() -> None:
    import argparse

    from services.gateway.service import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    for name in ("mistral", "qwen3_coder", "pythonic", "llama4_pythonic"):
        assert p.parse_args(["--model", "m", "--tool-call-parser", name]).tool_call_parser == name
    assert p.parse_args(["--model", "m", "--structured-outputs-in-reasoning"]).structured_outputs_in_reasoning
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--tool-call-parser", "nope"])
