"""Continuous batching without phases: each step gives every running sequence the tokens it still
needs (a whole prompt, a chunk of one, or one decode token) within a token budget, then admits
waiting sequences by priority. Returns a plan; does no I/O and runs no model.

It also holds every live request's state: held (blocks reserved, waiting for KV computed elsewhere),
waiting, running; and after a step, update_from_output turns the sampled tokens into outputs
(shared/engine/output_processor.py) and frees what finished.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.output_processor import OutputProcessor
from shared.engine.outputs import RequestOutput, TokenLogprobs
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


@dataclass(frozen=True)
class Reservation:
    num_cached_tokens: int  # prompt tokens already in this engine's prefix cache (whole blocks)
    block_hashes: list[bytes]  # hashes of the prompt's full blocks that may be fetched (never the last token's)
    num_blocks: int  # blocks reserved for the whole prompt
    committed: bool = False  # Reserve committed it at once (computed here from its prefix cache: commands.Reserve)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, outputs: OutputProcessor | None = None) -> None:
        self.bm = block_manager
        self.outputs = outputs  # the engine's; a scheduler that only plans (tests) needs none
        self.requests: dict[str, Sequence] = {}  # every live request, whatever its state
        self.held: dict[str, Sequence] = {}  # reserved, waiting for KV from elsewhere
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens  # prompt tokens of one request per step
        # Both kept sorted by Sequence.sort_key(): priority first, then arrival.
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []
        self.running: list[tuple[tuple[int, int], Sequence]] = []
        self.num_preemptions = 0
        # LoRA: at most this many distinct adapters in one step (the device slots); 0: no adapters served.
        self.max_loras = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, (seq.sort_key(), seq))

    # --- requests waiting for KV from elsewhere -------------------------------------------------

    def hold(self, seq: Sequence) -> Reservation | None:
        """Match the prefix cache and allocate blocks for the whole prompt without scheduling, so KV computed
        elsewhere can be written in. None when the pool is too full now (nothing changes)."""
        computed = self.bm.get_computed_blocks(seq)
        if not self.bm.allocate(seq, seq.num_tokens - len(computed) * self.bm.block_size, computed):
            return None
        seq.status = SequenceStatus.HELD
        self.held[seq.request_id] = seq
        full = (seq.num_tokens - 1) // self.bm.block_size
        return Reservation(seq.num_computed_tokens, list(seq.block_hashes[:full]), len(seq.block_table))

    def commit(self, request_id: str, num_computed_tokens: int) -> Sequence:
        """A held request's first num_computed_tokens are in place: it joins the running batch."""
        seq = self.held.pop(request_id)
        assert num_computed_tokens <= seq.num_tokens
        seq.num_computed_tokens = num_computed_tokens
        self.bm.cache_full_blocks(seq)
        self.add_running(seq)
        return seq

    def release(self, request_id: str) -> None:
        """Give up on KV from elsewhere: free the reserved blocks and queue the request to run here."""
        seq = self.held.pop(request_id)
        self.bm.free_blocks(seq)
        self.add(seq)

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
        """Whether a step has anything to compute (held requests wait for KV, not for steps)."""
        return bool(self.waiting or self.running)

    def sequences(self) -> list[Sequence]:
        """Every live request, held ones included."""
        return [s for _, s in self.running] + [s for _, s in self.waiting] + list(self.held.values())

    # --- after a step ---------------------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, sampled: list[tuple[Sequence, int, TokenLogprobs | None]],
                           now: float, verified: list[tuple[Sequence, list[int], list[TokenLogprobs | None]]] = ()
                           ) -> list[RequestOutput]:
        """The step computed plan's tokens and sampled `sampled`: advance, cache, append, finish, free.

        verified: sequences that verified drafts this step, with the tokens they keep (accepted drafts, then the
        target's own). Only the KV of their last token and of the accepted drafts counts as computed; the blocks
        past what they keep are given back, so a rejected token never reaches a block hash."""
        assert self.outputs is not None
        drafted = {id(seq) for seq, _, _ in verified}
        for seq, n in plan.scheduled:
            if id(seq) in drafted:
                seq.num_computed_tokens += 1  # its last token; the accepted drafts after they are appended
                continue
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
        pieces = self.outputs.captured_pieces(plan.scheduled)
        outs = pieces + [self.append_token(seq, token, lp, now) for seq, token, lp in sampled]
        for seq, tokens, lps in verified:
            outs.append(self.append_tokens(seq, tokens, lps, now))
            seq.spec_token_ids = []
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1  # every kept token but the last came from a draft
                self.bm.cache_full_blocks(seq)
                self.bm.trim(seq)
        return outs

    def append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float) -> RequestOutput:
        assert self.outputs is not None
        return self._output(seq, [token], self.outputs.append_token(seq, token, lp, now), now)

    def append_tokens(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprobs | None],
                      now: float) -> RequestOutput:
        """Append tokens in order until one finishes the request (a stop id, max_tokens, the model's length):
        those after it are dropped, exactly as if they had been decoded one at a time."""
        assert self.outputs is not None
        new: list[int] = []
        reason = None
        for token, lp in zip(tokens, lps):
            new.append(token)
            reason = self.outputs.append_token(seq, token, lp, now)
            if reason is not None:
                break
        return self._output(seq, new, reason, now)

    def _output(self, seq: Sequence, new: list[int], reason: str | None, now: float) -> RequestOutput:
        """The RequestOutput of the tokens just appended; a finish reason finishes and forgets the request."""
        assert self.outputs is not None
        kv = None
        if reason is not None:
            kv = self.outputs.take_prompt_kv(seq)  # prefill-only requests: before the blocks are freed
            seq.finish_reason = reason
            seq.finished_time = now
            self.finish(seq)
            del self.requests[seq.request_id]
        out = self.outputs.output(seq, new)
        if kv is not None:
            out.kv_blocks = kv
        return out

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is (held, waiting or running) and free its blocks."""
        seq = self.requests.pop(request_id, None)
        if self.outputs is not None:  # also for one never queued (its admission failed after it was routed)
            self.outputs.drop(request_id)
        if seq is None:
            return None
        if self.held.pop(request_id, None) is not None:
            self.bm.free_blocks(seq)
        self.finish(seq)
        seq.finish_reason = "abort"
        seq.finished_time = time.time()
        return seq

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
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        adapters: set[int] = set()  # the step's LoRA adapters (uids): a row of one more than max_loras waits
        for _, seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._adapter_fits(seq, adapters):
                continue
            n = min(seq.num_uncomputed_tokens, budget, self.chunk_cap)
            if seq.spec_token_ids:
                # A decoding sequence verifies its last token and its drafts in one row run (no chunk cap: it is
                # no prompt); drafts past the token budget are dropped.
                n = min(1 + len(seq.spec_token_ids), budget)
                del seq.spec_token_ids[n - 1 :]
            while not self.bm.can_allocate(seq, n):
                if seq.spec_token_ids:  # drop the drafts before preempting anyone for them
                    seq.spec_token_ids = []
                    n = 1
                    continue
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
            if not self._adapter_fits(seq, adapters):
                break
            computed = self.bm.get_computed_blocks(seq)
            n = min(seq.num_tokens - len(computed) * self.bm.block_size, budget, self.chunk_cap)
            if not self.bm.allocate(seq, n, computed):
                break
            del self.waiting[0]
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, (key, seq))
            out.scheduled.append((seq, n))
            budget -= n
        now = time.time()
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return out

    def _adapter_fits(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether seq's LoRA adapter can join the step (adding it to `adapters`): the oldest requests' adapters
        take the slots, a newer adapter's rows wait for a step with a slot free."""
        if seq.lora is None:
            return True
        if seq.lora.uid not in adapters:
            if len(adapters) >= self.max_loras:
                return False
            adapters.add(seq.lora.uid)
        return True
