"""A gateway with several API keys gives each key its own prefix cache: `cached_tokens` (and time to first token)
must not tell one tenant that another sent a prompt with the same prefix. A real mesh (nats-server, tokenizer,
decode worker, gateway with KVMESH_API_KEY="key-a,key-b") through the real openai client: the second key sees
no cached tokens for the first key's prompt, each key sees its own repeats cached, and an explicit cache_salt
works within a key without reaching another key's blocks under the same salt.
"""
from __future__ import annotations

import openai
import pytest

from services.gateway.auth import api_keys, check_api_key, tenant_salt
from services.gateway.errors import APIError
from tests.gateway_harness import one_decoder_mesh, openai_client

KEYS = "key-a, key-b"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "sectenants", api_key=KEYS) as m:
        yield m


def _cached(client: openai.OpenAI, prompt: list[int], stream: bool = False, **extra: str) -> int:
    if stream:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
    return out.usage.prompt_tokens_details.cached_tokens


def test_a_prompt_cached_by_one_key_is_no_hit_for_another(mesh) -> None:  # noqa: ANN001
    a, b = openai_client(mesh, "key-a"), openai_client(mesh, "key-b")
    prompt = list(range(200, 270))  # four full blocks of 16 tokens and a tail
    assert _cached(a, prompt) == 0
    assert _cached(a, prompt) == 64  # the same key: its own cache
    assert _cached(b, prompt) == 0  # another key: nothing of a's
    assert _cached(b, prompt, stream=True) == 64
    chat = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 8}]
    first = b.chat.completions.create(model="tiny", messages=chat, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = a.chat.completions.create(model="tiny", messages=chat, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_an_explicit_cache_salt_is_scoped_to_its_key(mesh) -> None:  # noqa: ANN001
    a, b = openai_client(mesh, "key-a"), openai_client(mesh, "key-b")
    prompt = list(range(400, 470))
    assert _cached(a, prompt, cache_salt="shared-name") == 0
    assert _cached(a, prompt, cache_salt="shared-name") == 64
    assert _cached(a, prompt) == 0  # the key's unsalted cache is another one
    assert _cached(a, prompt, cache_salt="other") == 0
    assert _cached(b, prompt, cache_salt="shared-name") == 0  # the same salt under another key: nothing shared
    # a salt another key's requests run under, sent explicitly, is scoped again: still no hit
    assert _cached(b, prompt, cache_salt=tenant_salt("key-a", "shared-name")) == 0


def test_keys_are_checked_and_a_wrong_one_refused(mesh) -> None:  # noqa: ANN001
    with pytest.raises(openai.AuthenticationError):
        openai_client(mesh, "key-c").completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert api_keys(KEYS) == ["key-a", "key-b"]
    assert check_api_key(KEYS, "Bearer key-b") == "key-b" and check_api_key(None, None) is None
    with pytest.raises(APIError):
        check_api_key(KEYS, "Bearer key-a, key-b")
    assert tenant_salt("key-a", None) != tenant_salt("key-b", None) != tenant_salt("key-b", "x")
