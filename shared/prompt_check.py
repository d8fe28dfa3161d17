"""The one place that judges a prompt's token ids: the gateway (before anything is sent), the
tokenizer (before its native decode, which overflows on negative ids and drops ids past the
vocabulary) and the engine (every internal message is checked again at the worker's boundary) all
call these, so the rules and the messages agree. Torch-free: the gateway and tokenizer import it."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class PromptError(ValueError):
    """A prompt that can never run. `param` and `code` are the OpenAI error's fields."""

    def __init__(self, message: str, param: str = "prompt", code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_token_ids(ids: Iterable[int], vocab_size: int, what: str = "prompt", param: str = "prompt") -> None:
    """Every id names a token of the vocabulary [0, vocab_size)."""
    ids = ids if isinstance(ids, Sequence) else list(ids)
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C-speed check for the common case
        return
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    prefix = "" if what == "prompt" else f"{what}: "
    raise PromptError(f"{prefix}token id {bad} is outside the vocabulary [0, {vocab_size})", param, "invalid_token_id")


def check_prompt(ids: Sequence[int], vocab_size: int, max_model_len: int | None = None) -> None:
    """Not empty, every id in the vocabulary, and room for at least one generated token."""
    if not ids:
        raise PromptError("prompt must contain at least one token", code="empty_prompt")
    check_token_ids(ids, vocab_size)
    if max_model_len is not None and len(ids) >= max_model_len:
        raise PromptError(f"prompt has {len(ids)} tokens; the model's context is {max_model_len} tokens",
                          code="context_length_exceeded")
