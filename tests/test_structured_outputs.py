"""Structured outputs (issue 11 item 1): response_format json_schema/json_object and vLLM's structured_outputs,
enforced by xgrammar token masks in the engine, through the real openai client against a real mesh on a
model with random weights: the mask alone must make every answer valid."""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "so", "qwen3") as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_100_requests_with_random_schemas_all_validate(client) -> None:  # noqa: ANN001
    rng = random.Random(0)
    jobs = [(rng.choice(SCHEMAS), rng.randrange(1000), rng.random() < 0.5, rng.random() < 0.3) for _ in range(100)]

    def one(job) -> tuple[dict, str, str]:  # noqa: ANN001
        schema, seed, chat, stream = job
        kw = dict(model="tiny", temperature=1.0, seed=seed, max_tokens=300, response_format=_fmt(schema))
        if chat:
            messages = [{"role": "user", "content": "Answer in JSON."}]
            if stream:
                chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
                text, reason = "", None
                for c in chunks:
                    if c.choices:
                        text += c.choices[0].delta.content or ""
                        reason = c.choices[0].finish_reason or reason
                return schema, text, reason
            c = client.chat.completions.create(messages=messages, **kw).choices[0]
            return schema, c.message.content, c.finish_reason
        # Completions take response_format too (a vLLM extension of OpenAI's API).
        kw["extra_body"] = {"response_format": kw.pop("response_format")}
        c = client.completions.create(prompt="JSON:", **kw).choices[0]
        return schema, c.text, c.finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    for schema, text, reason in results:
        assert reason == "stop", f"did not finish: {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(client) -> None:  # noqa: ANN001
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                       temperature=0, max_tokens=200, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":  # any JSON object may be long; when it ended it is one
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.lstrip().startswith("{")
    r = client.completions.create(model="tiny", prompt="Phone:", temperature=1.0, seed=1, max_tokens=40,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    for seed in range(5):
        r = client.completions.create(model="tiny", prompt="Pick:", temperature=1.0, seed=seed, max_tokens=20,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert r.choices[0].text in ("yes", "no", "maybe")


def test_bad_constraints_are_400s_naming_the_field(client, mesh) -> None:  # noqa: ANN001
    chat = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5)
    msg = expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        response_format=_fmt({"type": "objectx"}), **chat), 400, "response_format")
    assert "objectx" in msg
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        response_format={"type": "json_schema"}, **chat), 400, "response_format")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        response_format={"type": "yaml"}, **chat), 400, "response_format.type")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}, **chat), 400, "structured_outputs")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        extra_body={"structured_outputs": {"regex": "(unclosed"}}, **chat), 400, "response_format")
    # The mesh still serves after the bad ones.
    ok = client.chat.completions.create(response_format=_fmt(SCHEMAS[1]), temperature=0, **chat | {"max_tokens": 60})
    jsonschema.validate(json.loads(ok.choices[0].message.content), SCHEMAS[1])
