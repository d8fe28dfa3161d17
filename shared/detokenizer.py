"""Incremental, UTF-8-safe detokenization: token ids in, text deltas out.

Byte-level BPE splits rare characters into several byte tokens, and decoding a prefix that ends
mid-character gives U+FFFD. We use vLLM's prefix/read-offset technique: decode a short window
twice, once up to the last emitted token (`read`) and once to the end, and emit the difference
only when it does not end in a replacement character. The window starts a few tokens back
(`prefix`) because tokenizers such as SentencePiece decide leading spaces from context.
Cost per step is O(window), not O(output).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context, as vLLM does


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """One per generated sequence. `push` returns the text the new tokens complete; `flush` the rest."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # tokens before this have been emitted
        self.text = ""  # everything emitted so far

    def push(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        delta = self._delta(final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: emit what is left, replacement characters included.

        Afterwards `text` equals tokenizer.decode(all output ids), so streamed and non-streamed
        answers agree; an incomplete trailing character becomes U+FFFD exactly as decode() does.
        """
        delta = self._delta(final=True)
        self.text += delta
        return delta

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        prefix_text = self._decode(window[: self._read - self._prefix])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text):
            # e.g. a skipped special token: nothing visible, but the tokens are consumed
            if final or not new_text.endswith(REPLACEMENT):
                self._advance()
            return ""
        if new_text.endswith(REPLACEMENT) and not final:
            return ""  # the last character is incomplete: wait for its remaining bytes
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        # The window never looks before `prefix`; drop what it cannot see again.
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
