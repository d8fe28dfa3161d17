"""JSON strings under the engine's grammars (shared/engine/grammar.py) only take UTF-8: a byte-level model may
not write the three-byte encoding of a surrogate (ED A0-BF ..), which decodes to three replacement characters
and so breaks maxLength, nor a raw control character; real multi-byte characters still pass. Checked with
xgrammar's own matcher over a vocabulary of single bytes, for a bounded and an unbounded string."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from shared.engine.grammar import _strict_json_strings  # noqa: E402

SCHEMA = {"type": "object", "properties": {"short": {"type": "string", "maxLength": 10}, "long": {"type": "string"}},
          "required": ["short", "long"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammar():
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"], stop_token_ids=[256])
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True))
    return xgr.GrammarCompiler(info).compile_grammar(_strict_json_strings(ebnf))


def _accepts(grammar, data: bytes) -> bool:  # noqa: ANN001
    m = xgr.GrammarMatcher(grammar)
    return all(m.accept_token(b) for b in data)


@pytest.mark.parametrize("field", ["short", "long"])
def test_surrogates_and_control_characters_are_refused_utf8_is_not(grammar, field) -> None:  # noqa: ANN001
    head = b'{"short": "ok", "long": "' if field == "long" else b'{"short": "'
    assert _accepts(grammar, head + "é€😀".encode())
    assert _accepts(grammar, head + b"\xed\x9f\xbf")  # U+D7FF, the last code point before the surrogates
    assert not _accepts(grammar, head + b"\xed\xbc\xba")  # U+DF3A: not UTF-8
    assert not _accepts(grammar, head + b"\xed\xa0\x80")  # U+D800
    assert not _accepts(grammar, head + b"\x01")
