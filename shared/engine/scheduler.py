"""Continuous batching without phases: each step gives every running sequence the tokens it still
needs (a whole prompt, a chunk of one, or one decode token) within a token budget, then admits
waiting sequences by priority. Returns a plan; does no I/O and runs no model.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens  # prompt tokens of one request per step
        # Both kept sorted by Sequence.sort_key(): priority first, then arrival.
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []
        self.running: list[tuple[tuple[int, int], Sequence]] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, (seq.sort_key(), seq))

    def add_running(self, seq: Sequence) -> None:
        """A sequence admitted elsewhere (blocks already allocated) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, (seq.sort_key(), seq))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequences(self) -> list[Sequence]:
        return [s for _, s in self.running] + [s for _, s in self.waiting]

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks."""
        for queue in (self.running, self.waiting):
            i = bisect.bisect_left(queue, (seq.sort_key(),))
            if i < len(queue) and queue[i][1] is seq:
                del queue[i]
                break
        self.bm.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to waiting in arrival order."""
        self.running.remove((seq.sort_key(), seq))
        self.bm.free_blocks(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for _, seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget, self.chunk_cap)
            while not self.bm.can_allocate(seq, n):
                _, victim = self.running[-1]  # lowest priority, newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
        # Admitting while preempting would only thrash: the freed blocks belong to the victims.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            key, seq = self.waiting[0]
            computed = self.bm.get_computed_blocks(seq)
            n = min(seq.num_tokens - len(computed) * self.bm.block_size, budget, self.chunk_cap)
            if not self.bm.allocate(seq, n, computed):
                break
            del self.waiting[0]
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, (key, seq))
            out.scheduled.append((seq, n))
            budget -= n
        return out
