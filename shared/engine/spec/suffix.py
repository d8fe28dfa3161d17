"""Suffix proposer (after Arctic Inference's suffix decoding; own code): frequency-scored continuations of the
context's longest matching suffix, from the request's own prompt + output and from recent finished outputs.

A depth-D suffix structure is kept as count tables: for every context of 1..D tokens that occurred, how often
each next token followed it. Drafting walks greedily: match the longest suffix (D tokens down to 1) of the
context plus what is drafted so far, take its most frequent next token, multiply the run's score by that
token's empirical probability (count / all counts of the context), and stop when the score falls below
min_token_prob, when k tokens are drafted, or past max_spec_factor x the first match's length: a 1-token
match drafts one token, a long one many. So the speculation length is chosen per request, per step.

The request's own table (on Sequence.spec_index) is tried first; the worker-wide one holds the outputs of the
last max_cached_requests finished requests (a bounded FIFO: an evicted output's counts are subtracted). It is
kept per request cache salt (vLLM's cache_salt; "" for none): a salted request neither drafts from nor
feeds another salt's outputs, as its prefix-cache blocks are kept apart, so acceptance (and so timing) says
nothing across salts. The engine's own mesh-wide salt is the same for every request of an engine. Decode
workers may also learn each other's finished outputs (learn; services/decode/suffix_sharing.py, opt-in).
"""
from __future__ import annotations

import math
from collections import deque

from shared.engine.sequence import Sequence

Counts = dict[tuple[int, ...], dict[int, int]]


def add_counts(table: Counts, tokens: list[int], start: int, depth: int, sign: int = 1) -> None:
    """Count, for each position p >= start, tokens[p] after each of its 1..depth preceding contexts."""
    for p in range(max(start, 1), len(tokens)):
        nxt = tokens[p]
        for d in range(1, min(depth, p) + 1):
            ctx = tuple(tokens[p - d : p])
            row = table.get(ctx)
            if row is None:
                if sign < 0:
                    continue
                row = table[ctx] = {}
            c = row.get(nxt, 0) + sign
            if c > 0:
                row[nxt] = c
            else:
                row.pop(nxt, None)
                if not row:
                    del table[ctx]


class RequestTable:
    """A request's own counts, extended as its tokens grow."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: Counts = {}
        self.indexed = 0

    def update(self, tokens: list[int]) -> None:
        add_counts(self.counts, tokens, self.indexed, self.depth)
        self.indexed = len(tokens)


class SuffixProposer:
    def __init__(self, depth: int, max_cached_requests: int, min_token_prob: float, max_spec_factor: float) -> None:
        self.depth = depth
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.shared: dict[str, Counts] = {}  # cache salt ("" for none) -> counts of its recent outputs
        self.recent: deque[tuple[str, list[int]]] = deque()  # (salt, output), oldest first, across salts
        self.max_cached = max_cached_requests

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.spec_index is None:
            seq.spec_index = RequestTable(self.depth)
        own: RequestTable = seq.spec_index
        own.update(seq.token_ids)
        ctx = seq.token_ids[-self.depth :]
        shared = self.shared.get(seq.params.cache_salt or "", {})
        drafts: list[int] = []
        score = 1.0
        limit = k
        while len(drafts) < limit:
            hit = self._best(own.counts, ctx) or self._best(shared, ctx)
            if hit is None:
                break
            token, prob, matched = hit
            if not drafts:
                limit = min(k, max(1, math.ceil(matched * self.max_spec_factor)))
            score *= prob
            if score < self.min_token_prob:
                break
            drafts.append(token)
            ctx = (ctx + [token])[-self.depth :]
        return drafts

    @staticmethod
    def _best(table: Counts, ctx: list[int]) -> tuple[int, float, int] | None:
        """(most frequent next token, its share, match length) for the longest suffix of ctx in table."""
        for d in range(len(ctx), 0, -1):
            row = table.get(tuple(ctx[-d:]))
            if row:
                token = max(row, key=row.__getitem__)
                return token, row[token] / sum(row.values()), d
        return None

    def finished(self, seq: Sequence) -> None:
        """A finished request's output joins the worker-wide table (the oldest leaves past the bound)."""
        self.learn(seq.params.cache_salt, seq.output_token_ids)

    def learn(self, cache_salt: str | None, out: list[int]) -> None:
        """An output joins the worker-wide table of its salt: this worker's, or another decode worker's
        (services/decode/suffix_sharing.py); the oldest leaves past the bound."""
        if len(out) < 2:
            return
        salt = cache_salt or ""
        add_counts(self.shared.setdefault(salt, {}), out, 1, self.depth)
        self.recent.append((salt, out))
        while len(self.recent) > self.max_cached:
            old_salt, old_out = self.recent.popleft()
            table = self.shared[old_salt]
            add_counts(table, old_out, 1, self.depth, sign=-1)
            if not table:
                del self.shared[old_salt]
