"""The draft model's paged KV bookkeeping: its own block pool and one shadow sequence per drafting request.

The draft model's KV lives in its own pool (shared/engine/spec/draft_model.py allocates it from the draft's
config), with its own block ids: the target's blocks are shared through the prefix cache, filled by remote
prefill or the kvstore and trimmed after each verify, none of which the draft sees, so the draft never reads them.

Per request a shadow Sequence (the runner's own input type) holds what the draft has computed: token_ids are the
request's context as the draft last saw it plus the tokens it drafted, num_computed_tokens how many of them have
their draft KV in the pool, block_table the draft blocks (only ever appended to, as shared/engine/block_tables.py
expects). Rollback is lazy: before drafting again, sync() keeps the KV of the longest common prefix of the shadow's
tokens and the request's (the accepted drafts), and the next forward overwrites the rejected positions.

A request's draft blocks are freed when it finishes or is aborted, and when it is no longer running at a
propose (preempted: the draft recomputes its context after readmission, as the target does).
"""
from __future__ import annotations

from shared.engine.sequence import Sequence


class DraftKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self.shadows: dict[str, Sequence] = {}
        self.confirmed: dict[str, int] = {}  # tokens of the shadow known to equal the request's (its context)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def sync(self, seq: Sequence, extra: int) -> Sequence | None:
        """The request's shadow, rolled back to the draft KV still valid for its tokens, with blocks for `extra`
        positions past its context (the drafts this step writes KV for); None when the pool cannot hold them
        (the request drafts nothing this step, and keeps what it has)."""
        shadow = self.shadows.get(seq.request_id)
        have = 0 if shadow is None else len(shadow.block_table)
        need = -(-(seq.num_tokens + extra) // self.block_size) - have
        if need > len(self.free):
            return None
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids, seq.params)
            self.shadows[seq.request_id] = shadow
            self.confirmed[seq.request_id] = 0
        valid = min(self.confirmed[seq.request_id], seq.num_tokens - 1)  # the request only appends: tokens
        # below what the last sync saw still agree
        # At most the context but its last token: the first forward needs a row whose logits draft the next token.
        limit = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        mine, theirs = shadow.token_ids, seq.token_ids
        while valid < limit and mine[valid] == theirs[valid]:
            valid += 1
        for _ in range(need):
            shadow.block_table.append(self.free.pop())
        shadow.token_ids = list(theirs)
        shadow.num_computed_tokens = min(valid, shadow.num_computed_tokens)
        self.confirmed[seq.request_id] = seq.num_tokens
        return shadow

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.confirmed.pop(request_id, None)
        if shadow is not None:
            self.free.extend(reversed(shadow.block_table))
            shadow.block_table = []

    def retain(self, request_ids: set[str]) -> None:
        """Free every shadow whose request is not among request_ids (finished, aborted or preempted)."""
        for rid in [r for r in self.shadows if r not in request_ids]:
            self.release(rid)

    def check_integrity(self, live: set[str]) -> None:
        owned = [b for s in self.shadows.values() for b in s.block_table]
        assert len(owned) == len(set(owned)), "a draft block is owned twice"
        assert not set(owned) & set(self.free), "a draft block is both owned and free"
        assert len(owned) + len(self.free) == self.num_blocks, "draft blocks leaked"
        assert set(self.shadows) <= live, f"draft KV kept for gone requests {sorted(set(self.shadows) - live)}"
        for s in self.shadows.values():
            assert s.num_computed_tokens <= len(s.block_table) * self.block_size
