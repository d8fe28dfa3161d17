"""After a step: what a sampled token does to its request, and the RequestOutput a service sees.

Appending the token (and its logprobs, and the grammar's state), deciding whether the request is done
(stop tokens, a complete grammar, max_tokens, the model's length), building outputs, and handing out
the prompt KV of prefill-only requests (capture_kv_from_block). The scheduler calls it from
update_from_output and frees what finished; it touches no queue and no block itself.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.kv_blocks import KVBlocks
from shared.engine.sequence import Sequence

ReadBlocks = Callable[[Seq[int]], tuple[torch.Tensor, torch.Tensor]]


class OutputProcessor:
    def __init__(self, block_size: int, max_model_len: int, stop_ids: Callable[[Sequence], list[int]],
                 read_blocks: ReadBlocks) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._stop_ids = stop_ids
        self._read_blocks = read_blocks
        # Prefill-only requests: request id -> the first logical block whose KV has not been handed out yet.
        self.capture_kv: dict[str, int] = {}

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
        first = self.capture_kv.pop(seq.request_id, None)
        if first is None:
            return None
        last = -(-seq.num_prompt_tokens // self.block_size)
        return KVBlocks(*self._read_blocks(seq.block_table[first:last]), first_block=first)

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
            out = self.output(seq, [])
            out.kv_blocks = KVBlocks(*self._read_blocks(seq.block_table[start:done]), first_block=start)
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
