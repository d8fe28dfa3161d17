"""Values JSON allows but the bus cannot carry (issue 20 item 7), over real HTTP against a real mesh: an
integer beyond 64 bits in any numeric field and a lone surrogate in any text gave 500s ("Integer value out
of range" when the request was encoded for the worker, UnicodeEncodeError in the tokenizer). Each is a
400 naming the field, and the mesh keeps serving."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway_harness import one_decoder_mesh

BIG = 2**70
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "unsendable") as m:
        yield m


def _post(mesh, path: str, body: dict) -> httpx.Response:  # noqa: ANN001
    # json.dumps escapes a lone surrogate as \ud800 (valid JSON); clients that encode UTF-8 first cannot send it.
    return httpx.post(f"{mesh.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


def _still_serves(mesh) -> None:  # noqa: ANN001
    r = _post(mesh, "/v1/completions", {**COMPLETION, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


INT_FIELDS = ["max_tokens", "top_k", "min_tokens", "seed", "priority", "n", "logprobs"]


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("field", INT_FIELDS)
def test_integers_beyond_64_bits_are_400s_naming_the_field(mesh, field: str, sign: int) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)
    kw = {"max_tokens": 2, "extra_body": {}}
    if field in ("max_tokens", "seed", "n", "logprobs"):  # the client's own parameters
        kw[field] = sign * BIG
    else:
        kw["extra_body"][field] = sign * BIG
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", **kw)
    assert err.value.status_code == 400 and field in err.value.message


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1": BIG}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(BIG): 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [-BIG]}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, BIG]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, BIG]]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "top_k": BIG}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": BIG}, "top_logprobs"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": BIG}, "max_output_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "top_k": BIG}, "top_k"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
])
def test_every_numeric_field_out_of_range_is_a_400(mesh, path: str, body: dict, param: str) -> None:  # noqa: ANN001
    r = _post(mesh, path, body)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", "a\ud800"]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "stop": "\udfff"}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/responses", {"model": "tiny", "input": "x\ud800"}, "input"),
    ("/tokenize", {"prompt": "a\ud800"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(mesh, path: str, body: dict, param: str) -> None:  # noqa: ANN001
    r = _post(mesh, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_the_mesh_keeps_serving_after_them(mesh) -> None:  # noqa: ANN001
    for _ in range(3):
        assert _post(mesh, "/v1/completions", {**COMPLETION, "top_k": BIG}).status_code == 400
        assert _post(mesh, "/v1/completions", {**COMPLETION, "prompt": "\ud800"}).status_code == 400
    _still_serves(mesh)
    # Valid large values still pass: top_k beyond the vocabulary means "no top-k", 2**62 fits the wire.
    assert _post(mesh, "/v1/completions", {**COMPLETION, "top_k": 2**62}).status_code == 200
