"""Bounded input (issue 9 item 4) over real HTTP against a real mesh: the API key before the body, a body
limit checked while the body streams in (413), every error with a code, and the tokenizer's own cap."""
from __future__ import annotations

import httpx
import openai
import pytest

from shared import bus, subjects
from shared.protocol.tokenizer import EncodeReply, EncodeRequest
from services.gateway.intake import default_body_limit
from tests.gateway_harness import one_decoder_mesh

KEY = "sk-bounded"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "bounded", api_key=KEY, max_body_bytes=LIMIT) as m:
        yield m


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_key_is_checked_before_the_body_is_parsed(mesh) -> None:  # noqa: ANN001
    r = httpx.post(f"{mesh.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{mesh.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 400 and r.json()["error"]["code"]
    assert httpx.get(f"{mesh.url}/health", timeout=10).status_code in (200, 503)  # open paths stay open
    assert httpx.get(f"{mesh.url}/version", timeout=10).status_code == 200


def test_oversized_bodies_are_413_by_length_and_while_streaming(mesh) -> None:  # noqa: ANN001
    big = b'{"model": "tiny", "prompt": "' + b"a" * (LIMIT + 10) + b'"}'
    r = httpx.post(f"{mesh.url}/v1/completions", content=big, headers={"content-type": "application/json", **AUTH},
                   timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 4096 + 2):
            yield b"b" * 4096
        yield b'"}'
    r = httpx.post(f"{mesh.url}/v1/completions", content=chunks(), headers={"content-type": "application/json", **AUTH},
                   timeout=10)
    assert r.status_code == 413
    ok = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=KEY, max_retries=0, timeout=30).completions.create(
        model="tiny", prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    assert default_body_limit(40960) == (1 << 20) + 64 * 40960


def test_every_error_carries_a_code(mesh) -> None:  # noqa: ANN001
    cases = [httpx.get(f"{mesh.url}/nope", headers=AUTH, timeout=10),
             httpx.delete(f"{mesh.url}/v1/completions", headers=AUTH, timeout=10),
             httpx.post(f"{mesh.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 99}, headers=AUTH,
                        timeout=10),
             httpx.post(f"{mesh.url}/v1/completions", json={"model": "tiny", "prompt": "x", "suffix": "y"}, headers=AUTH,
                        timeout=10)]
    for r in cases:
        err = r.json()["error"]
        assert r.status_code >= 400 and err["code"], (r.status_code, err)


def test_the_tokenizer_refuses_input_beyond_its_cap(mesh) -> None:  # noqa: ANN001
    mesh.tokenizer.max_input_chars = 1000

    async def ask(n: int) -> object:
        try:
            return await bus.request(mesh.nc, subjects.TOKENIZER_ENCODE, EncodeRequest(prompt="x" * n), timeout=10,
                                     expect=EncodeReply)
        except bus.RemoteError as e:
            return e
    try:
        refused = mesh.call(ask(5000))
        assert isinstance(refused, bus.RemoteError) and "exceeds the tokenizer's limit" in refused.message
        assert isinstance(mesh.call(ask(10)), EncodeReply)
    finally:
        mesh.tokenizer.max_input_chars = 8 << 20
