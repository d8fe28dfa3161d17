"""What the engine hands back per request, per step (streaming) or at the end (offline)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.kv_blocks import KVBlocks
from shared.token_logprobs import TokenLogprobs

__all__ = ["RequestOutput", "TokenLogprobs"]


@dataclass
class RequestOutput:
    """A finished output holds the whole request; an unfinished (streamed) one only what the stream sends:
    new_token_ids and their logprobs, prompt_logprobs with the first token, empty prompt/output lists."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]  # tokens produced by the step that built this output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with params.prompt_logprobs
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None
    finished_time: float | None = None
    # Prefill-only requests (capture_kv_from_block): K and V of prompt blocks from capture_kv_from_block on,
    # each [layers, blocks, block_size, kv_heads, head_dim], on CPU. An unfinished output carries the
    # blocks a prefill chunk completed; the finished one the rest (the last partial block included).
    kv_blocks: KVBlocks | None = None
