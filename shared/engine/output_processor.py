"""After a step: what a sampled token does to its request, and the RequestOutput a service sees.

Appending the token (and its logprobs, and the grammar's state), deciding whether the request is done
(stop tokens, a complete grammar, max_tokens, the model's length), building outputs, and handing out
the prompt KV of prefill-only requests (capture_kv_from_block). The scheduler calls it from
update_from_output and frees what finished; it touches no queue and no block itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.kv_blocks import KVBlocks
from shared.engine.sequence import Sequence
from shared.engine.tp.shard_link import ShardSendError

ReadBlocks = Callable[[Seq[int]], tuple[torch.Tensor, torch.Tensor]]
# Rank-to-rank (shared/engine/tp/shard_link.py): (target, block ids, first logical block, final) -> rank 0's shard,
# after every other rank sent its own; raises when one could not.
SendShards = Callable[[Any, Seq[int], int, bool], tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, block_size: int, max_model_len: int, stop_ids: Callable[[Sequence], list[int]],
                 read_blocks: ReadBlocks) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._stop_ids = stop_ids
        self._read_blocks = read_blocks
        # Prefill-only requests: request id -> the first logical block whose KV has not been handed out yet.
        self.capture_kv: dict[str, int] = {}
        # Prefill-only requests whose KV goes rank to rank: request id -> (target, the runner's send).
        self.by_rank: dict[str, tuple[Any, SendShards]] = {}
        self.abandon_shards: Callable[[str], None] | None = None  # the runner's, for a request aborted mid-way
        self.handout_s = 0.0  # seconds spent reading (or sending rank to rank) captured KV, cumulative

    def route_by_rank(self, request_id: str, target: Any, send: SendShards, abandon: Callable[[str], None]) -> None:
        """Before the request is queued: its captured KV leaves rank by rank (each piece's follower shards sent
        first; kv_blocks then hold rank 0's shard only)."""
        self.by_rank[request_id] = (target, send)
        self.abandon_shards = abandon

    def drop(self, request_id: str) -> None:
        """An aborted request: nothing more to hand out; followers sending its pieces rank to rank let them go."""
        self.capture_kv.pop(request_id, None)
        route = self.by_rank.pop(request_id, None)
        if route is not None and self.abandon_shards is not None:
            self.abandon_shards(route[0].transfer_id)

    def _captured(self, seq: Sequence, first: int, last: int) -> KVBlocks | None:
        """K/V of logical blocks [first, last) of a prefill-only request: whole, or rank 0's shard after the other
        ranks sent theirs (None when one could not: the transfer is given up, its decode worker computes it)."""
        ids = seq.block_table[first:last]
        route = self.by_rank.get(seq.request_id)
        t0 = time.perf_counter()
        try:
            if route is None:
                return KVBlocks(*self._read_blocks(ids), first_block=first)
            target, send = route
            return KVBlocks(*send(target, ids, first, last * self.block_size >= seq.num_prompt_tokens),
                            first_block=first)
        except ShardSendError as e:
            log.warning("rank-to-rank KV of %s failed: %s", seq.request_id, e)
            self.capture_kv.pop(seq.request_id, None)
            self.by_rank.pop(seq.request_id, None)
            return None
        finally:
            self.handout_s += time.perf_counter() - t0

    def append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float) -> str | None:
        """Record a sampled token; returns the finish reason it brings (None: the request goes on)."""
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.reasoning_over:
            # Reasoning: the grammar starts with the token after its end marker (the marker is not its text).
            end = seq.params.reasoning_end_ids or []
            seq.reasoning_over = seq.num_output_tokens >= len(end) and seq.token_ids[-len(end):] == end
        elif seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(token)
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.first_token_time is None:
            seq.first_token_time = now
        return self.finish_reason(seq, token)

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.matcher is not None and seq.reasoning_over and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete (it accepted a stop token)
        if seq.num_output_tokens >= p.min_tokens and token in self._stop_ids(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def take_prompt_kv(self, seq: Sequence) -> KVBlocks | None:
        """A finishing prefill-only request's prompt KV not yet handed out (read before its blocks are freed)."""
        first = self.capture_kv.get(seq.request_id)
        if first is None:
            return None
        last = -(-seq.num_prompt_tokens // self.block_size)
        kv = self._captured(seq, first, last)
        self.capture_kv.pop(seq.request_id, None)
        self.by_rank.pop(seq.request_id, None)
        return kv

    def captured_pieces(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """For prefill-only requests still computing their prompt: the K/V of the blocks this step
        completed, as an unfinished output, so they travel while the next chunk computes (the rest,
        the last partial block included, comes with the finished output of the step that samples)."""
        pieces = []
        for seq, _ in scheduled:
            start = self.capture_kv.get(seq.request_id)
            if start is None or seq.num_computed_tokens == seq.num_tokens:  # sampling now: finishes after
                continue
            done = seq.num_computed_tokens // self.block_size
            if done <= start:
                continue
            kv = self._captured(seq, start, done)
            if kv is None:
                continue
            out = self.output(seq, [])
            out.kv_blocks = kv
            self.capture_kv[seq.request_id] = done
            pieces.append(out)
        return pieces

    @staticmethod
    def output(seq: Sequence, new: list[int]) -> RequestOutput:
        """A finished output carries everything; a streamed one only what a stream sends (its new tokens and
        their logprobs, the prompt logprobs with the first token): copying each sequence's prompt and output
        on every token was most of a decode step's host time at batch 128 and 4k-token prompts."""
        done = seq.is_finished
        first = bool(new) and seq.num_output_tokens == len(new)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = list(seq.logprobs) if done else (seq.logprobs[-len(new):] if new else [])
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and (done or first):
            prompt_logprobs = list(seq.prompt_logprobs) or [None]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids if done else [],
            output_token_ids=seq.output_token_ids if done else [],
            new_token_ids=new,
            finished=done,
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
        )
