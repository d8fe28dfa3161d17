"""Special tokens kept in the output text (skip_special_tokens=false), standing apart from the text around
them when spaces_between_special_tokens is true (vLLM's default): each special token's text is one item,
and items are joined by one space, as transformers' slow tokenizers decode. Fast tokenizers never add
those spaces, so this is done here, over the incremental detokenizer of the text between them."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from shared.detokenizer import IncrementalDetokenizer


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids decode() drops under skip_special_tokens: the named special tokens and added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return frozenset(ids)


class SpacedDetokenizer:
    """push(ids) -> text delta, flush() -> the rest: the incremental detokenizer's contract."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], special: frozenset[int]) -> None:
        self._tok = tokenizer
        self._special = special
        self._inner = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=False)
        self._written = False  # some item is out: the next one is joined by a space
        self._space_next = False  # the last item was a special token

    def push(self, token_ids: Iterable[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for t in token_ids:
            if t not in self._special:
                run.append(t)
                continue
            if run:
                out.append(self._text(self._inner.push(run)))
                run = []
            out.append(self._text(self._inner.flush()))
            out.append((" " if self._written else "") + self._tok.decode([t], skip_special_tokens=False))
            self._written = self._space_next = True
            # The text after a special token is a new item: it decodes on its own, without context.
            self._inner = IncrementalDetokenizer(self._tok, (), skip_special_tokens=False)
        if run:
            out.append(self._text(self._inner.push(run)))
        return "".join(out)

    def flush(self) -> str:
        return self._text(self._inner.flush())

    def _text(self, s: str) -> str:
        if not s:
            return ""
        if self._space_next:
            s, self._space_next = " " + s, False
        self._written = True
        return s
