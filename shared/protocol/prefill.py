"""decode -> prefill: compute a long uncached prompt tail remotely and push its KV back."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from shared.protocol.generate import TokenLogprob
from shared.sampling_params import SamplingParams
from shared.wire import Message


class RemotePrefillRequest(Message):
    """The decode worker owns the destination blocks; it says how many, never which ids.

    The prefill worker pushes KVBlockChunks for transfer `transfer_id` to
    `subjects.decode_kv_push(decode_worker_id)`, covering logical blocks
    [num_cached_tokens // block_size, num_cached_tokens // block_size + num_dest_blocks).
    """

    KIND: ClassVar[str] = "prefill.request"

    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prefix the decode worker already holds (a multiple of block_size)
    decode_worker_id: str
    num_dest_blocks: int
    block_size: int
    sampling: SamplingParams = Field(default_factory=SamplingParams)  # for the first token
    # The decode worker's direct KV channel (tcp://host:port; shared memory when on one host) and the
    # token a push on it must carry. None: push over NATS.
    kv_endpoint: str | None = None
    kv_token: bytes = b""
    # A tensor-parallel decode worker's ranks 1..N-1 (direct channels, same token): a prefill worker of the same
    # degree sends each rank's head shard to its rank (kv_endpoint gets rank 0's), any other sends whole blocks.
    kv_rank_endpoints: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _ranges(self) -> RemotePrefillRequest:
        if not 0 <= self.num_cached_tokens < len(self.prompt_token_ids):
            raise ValueError("num_cached_tokens must leave at least one prompt token to prefill")
        if self.block_size <= 0 or self.num_dest_blocks < 0:
            raise ValueError("block_size must be positive and num_dest_blocks non-negative")
        return self


class RemotePrefillReply(Message):
    KIND: ClassVar[str] = "prefill.reply"

    request_id: str
    transfer_id: str
    first_token_id: int | None = None  # None when error is set
    logprobs: TokenLogprob | None = None
    num_cached_tokens: int = 0  # how much of the tail the prefill worker found in its own cache
    error: str | None = None
