"""Output text under skip_special_tokens / spaces_between_special_tokens, as vLLM's detokenizer for fast
tokenizers writes it.

skip_special_tokens (default true) drops special tokens' text. With it false, spaces_between_special_tokens
(default true) leaves the text as the tokenizer's decoder writes it; false writes a special token that follows
another special token as its bare text, without whatever the decoder puts between tokens (a space, for
tokenizers without a decoder or with a WordPiece one). Byte-level BPE decoders put nothing there, so for them
both settings read the same (as in vLLM).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from shared.detokenizer import IncrementalDetokenizer
from shared.sampling_params import SamplingParams


def added_tokens(tokenizer: Any) -> dict[int, str]:
    """Token id -> text of every added token (vLLM's map for this rule: special or not)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): t.content for i, t in decoder.items()}


def output_detokenizer(tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                       added: dict[int, str]) -> Any:
    """The incremental detokenizer (push(ids) -> delta, flush() -> rest) a request's settings call for."""
    if not params.skip_special_tokens and not params.spaces_between_special_tokens and added:
        return AdjacentSpecialDetokenizer(tokenizer, prompt_token_ids, added)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)


class AdjacentSpecialDetokenizer:
    """skip_special_tokens=false, spaces_between_special_tokens=false: an added token right after another one
    is written as its bare text (vLLM's FastIncrementalDetokenizer does the same, token by token)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], added: dict[int, str]) -> None:
        self._inner = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=False)
        self._added = added
        self._last_added = False

    def push(self, token_ids: Iterable[int]) -> str:
        out = []
        for t in token_ids:
            piece = self._inner.push([t])
            bare = self._added.get(t)
            if bare is not None and self._last_added:
                piece = bare
            self._last_added = bare is not None
            out.append(piece)
        return "".join(out)

    def flush(self) -> str:
        return self._inner.flush()
