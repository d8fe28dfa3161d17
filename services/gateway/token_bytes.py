"""The raw bytes of each token, for logprobs' `bytes` and completions' `text_offset`.

A character of several UTF-8 bytes (an emoji) is often split across tokens; each token alone decodes
to U+FFFD, so `list(text.encode())` of its text is wrong, and so is an offset counted in such texts.
OpenAI's `bytes` is the token's own bytes (a client joins them to rebuild the character); offsets
index into the returned text, so a token that only starts a character sits where that character will.
"""
from __future__ import annotations

import codecs
import re
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character byte-level BPE writes for each byte.
    Built once and shared (only read): every streamed request builds a TokenBytes, and building this table
    took ~0.5 ms of the gateway's CPU per request in a profile of the gateway."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """Token id -> its bytes, for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tok = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._decoder = _gpt2_byte_decoder()
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))  # not in the text (detokenized without them)
        self.of = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m[1], 16)])
            if self.byte_level and all(c in self._decoder for c in piece):
                return bytes(self._decoder[c] for c in piece)
        return self.tok.decode([token_id], skip_special_tokens=False).encode()


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        return b'"ByteLevel"' in decoder.__getstate__()  # the decoder's own JSON (a Sequence may hold it)
    except Exception:  # noqa: BLE001 - another backend: not byte-level as far as we can tell
        return type(decoder).__name__ == "ByteLevel"


class TextOffsets:
    """Offsets (in characters of the text) of a stream of tokens: each token's offset is the length of
    the complete characters before it."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def push(self, token_id: int) -> int:
        """The token's offset; then counts the characters it completes."""
        at = self.chars
        if token_id not in self._bytes.special:
            self.chars += len(self._utf8.decode(self._bytes.of(token_id)))
        return at
