"""Speculation under a structured-output grammar: drafts the grammar allows, and the mask at every drafted position.

A drafted token the grammar rejects can never be kept (the target's mask forbids it), so verifying it and all
after it is wasted work: the draft is cut before it (grammar_prefix). At verify time row j of a request (its
last token, then each draft) must be sampled under the mask of the grammar state after drafts[:j], as if they
had been decoded one by one: the matcher is advanced through the drafts while the rows are filled, then rolled
back to where it was (xgrammar's GrammarMatcher.rollback; unlimited since 0.1.2x). The matcher itself only ever
accepts kept tokens, in OutputProcessor.append_token, so a rejected draft never advances it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shared.engine.sequence import Sequence


def grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts the matcher accepts from its current state (which it is left in)."""
    n = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


def fill_draft_rows(matcher: Any, drafts: list[int], mask: torch.Tensor, first_row: int) -> None:
    """Rows first_row .. first_row + len(drafts) of mask: the grammar's next-token mask before each draft and
    after the last. A row past a draft that completed the grammar stays free: the request stops at that draft,
    so nothing sampled there is kept."""
    advanced = 0
    try:
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(mask, first_row + j)
            if j < len(drafts):
                # grammar_prefix cut the draft where the grammar stopped accepting; the scheduler only shortens it.
                assert matcher.accept_token(drafts[j]), "a draft the grammar rejects reached the verify step"
                advanced += 1
    finally:
        if advanced:
            matcher.rollback(advanced)


def draft_bitmask(allocate: Callable[[int], torch.Tensor], drafts: list[tuple[Sequence, int]]) -> torch.Tensor | None:
    """The verify step's mask, [sum(k + 1), words] in its row order, or None when no verifying request has an
    active grammar (rows of requests without one allow every token)."""
    if not any(seq.matcher is not None and seq.reasoning_over for seq, _ in drafts):
        return None
    mask = allocate(sum(k + 1 for _, k in drafts))
    row = 0
    for seq, k in drafts:
        if seq.matcher is not None and seq.reasoning_over:
            fill_draft_rows(seq.matcher, seq.spec_token_ids[:k], mask, row)
        row += k + 1
    return mask
