"""A sequence as the sampler sees it at one position of a verify step: its tokens plus the drafts before it.

The verify step samples the target at every drafted position with the normal sampler's own code, and that
code reads a row's context (penalties count its tokens, min_tokens its output length, a seeded row draws
from its generator). At draft position j the context is the sequence's tokens followed by drafts[:j]: this
view gives exactly that, so every processing step applies to the target probabilities as it would had the
drafts been decoded one by one.
"""
from __future__ import annotations

from shared.engine.sequence import Sequence


class DraftPosition:
    __slots__ = ("seq", "drafts", "params", "plain_greedy", "min_tokens", "num_output_tokens", "request_id")

    def __init__(self, seq: Sequence, drafts: list[int]) -> None:
        self.seq = seq
        self.drafts = drafts
        self.params = seq.params
        self.plain_greedy = seq.plain_greedy
        self.min_tokens = seq.min_tokens
        self.num_output_tokens = seq.num_output_tokens + len(drafts)
        self.request_id = seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    # The request's own generator (seeded requests), shared by all its positions: draws continue one stream.
    @property
    def generator(self):  # noqa: ANN201 - torch.Generator | None
        return self.seq.generator

    @generator.setter
    def generator(self, value) -> None:  # noqa: ANN001
        self.seq.generator = value


def positions(seq: Sequence, k: int) -> list[DraftPosition]:
    """The k + 1 rows of a sequence verifying its first k drafts."""
    return [DraftPosition(seq, seq.spec_token_ids[:j]) for j in range(k + 1)]
