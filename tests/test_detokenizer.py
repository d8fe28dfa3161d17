"""Incremental detokenization: the DecodeStream path and the hand-written window give the same text on real
byte-level BPE and SentencePiece tokenizers, never emit half a character, and flush like decode()."""
from __future__ import annotations

import pytest

from shared.detokenizer import (REPLACEMENT, IncrementalDetokenizer, StreamDetokenizer, WindowDetokenizer)
from tests.detok_tokenizers import byte_level_bpe, sentencepiece_bpe

TEXT = "Grüße aus 東京 — naïve café 🎉 ok"


@pytest.fixture(scope="module", params=["byte-level-bpe", "sentencepiece"])
def tokenizer(request, tmp_path_factory):  # noqa: ANN001, ANN201
    if request.param == "byte-level-bpe":
        return byte_level_bpe(tmp_path_factory.mktemp("tok"))
    return sentencepiece_bpe()


@pytest.fixture(params=["stream", "window"])
def make(request):  # noqa: ANN001, ANN201
    def build(tok, prompt=()):  # noqa: ANN001, ANN202
        if request.param == "stream":
            return StreamDetokenizer(tok, tok.backend_tokenizer, prompt)
        return WindowDetokenizer(tok, prompt)
    return build


def test_factory_picks_decode_stream_for_fast_tokenizers(tokenizer) -> None:  # noqa: ANN001
    assert isinstance(IncrementalDetokenizer(tokenizer), StreamDetokenizer)

    class Plain:
        def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001, ANN202
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert isinstance(IncrementalDetokenizer(Plain()), WindowDetokenizer)


def test_never_emits_half_a_character(tokenizer, make) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    singles = [tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT in s for s in singles), "the test needs a character split across byte tokens"
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    detok = make(tokenizer, prompt)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.flush())
    assert all(REPLACEMENT not in d for d in deltas)
    # After a prompt, SentencePiece keeps the continuation's leading space; byte-level BPE has it in the text.
    assert "".join(deltas).lstrip(" ") == TEXT == detok.text.lstrip(" ")
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to wait for the rest of their character


def test_both_implementations_agree_token_by_token(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT + " and more text 東京", add_special_tokens=False)
    prompt = tokenizer.encode("Hi there", add_special_tokens=False)
    stream = StreamDetokenizer(tokenizer, tokenizer.backend_tokenizer, prompt)
    window = WindowDetokenizer(tokenizer, prompt)
    for i in ids:
        assert stream.push([i]) == window.push([i])
    assert stream.flush() == window.flush()
    assert stream.text == window.text


def test_chunks_and_special_tokens(tokenizer, make) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = make(tokenizer)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3))
    out += detok.push([tokenizer.eos_token_id]) + detok.flush()
    assert out == TEXT


def test_flush_matches_decode_for_truncated_character(tokenizer, make) -> None:  # noqa: ANN001
    ids = tokenizer.encode("a🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = make(tokenizer)
    streamed = "".join(detok.push([i]) for i in ids)
    assert REPLACEMENT not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)


def test_prompt_ending_mid_character_does_not_leak_into_the_output(tokenizer, make) -> None:  # noqa: ANN001
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split across byte tokens"
    out = tokenizer.encode(" hello", add_special_tokens=False)
    detok = make(tokenizer, ids[:1])  # the prompt ends inside the character
    text = "".join(detok.push([i]) for i in out) + detok.flush()
    assert REPLACEMENT not in text and text.strip() == "hello"
