"""N-gram (prompt lookup) proposer: the longest suffix of the context (prompt + output so far) that occurred
earlier proposes the tokens that followed its latest earlier occurrence.

Each request keeps an index (on Sequence.spec_index) from every n-gram, prompt_lookup_min <= n <=
prompt_lookup_max, that has a token after it to the latest position it started at, updated as tokens are
appended: a lookup is max - min + 1 dict reads instead of a scan of the whole context every step.
"""
from __future__ import annotations

from shared.engine.sequence import Sequence


class NgramIndex:
    def __init__(self, nmin: int, nmax: int) -> None:
        self.nmin, self.nmax = nmin, nmax
        self.starts: dict[tuple[int, ...], int] = {}  # n-gram (any n) -> latest start with a following token
        self.indexed = 0  # context length already indexed

    def extend(self, tokens: list[int]) -> None:
        for length in range(max(self.indexed, 1) + 1, len(tokens) + 1):
            # The n-grams ending at length - 2 now have a token after them.
            end = length - 1
            for n in range(self.nmin, min(self.nmax, end) + 1):
                self.starts[tuple(tokens[end - n : end])] = end - n
        self.indexed = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        self.extend(tokens)
        for n in range(min(self.nmax, len(tokens) - 1), self.nmin - 1, -1):
            start = self.starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.nmin, self.nmax = prompt_lookup_min, prompt_lookup_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.spec_index is None:
            seq.spec_index = NgramIndex(self.nmin, self.nmax)
        return seq.spec_index.lookup(seq.token_ids, k)

    def finished(self, seq: Sequence) -> None:
        """Nothing outlives a request here (its index goes with the Sequence)."""
