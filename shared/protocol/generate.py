"""gateway <-> decode: one generate request in, a stream of TokenChunks out; cancels fan out."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.token_logprobs import TokenLogprobs
from shared.sampling_params import SamplingParams
from shared.wire import Message, WireModel

FINISH_REASONS = ("stop", "length", "abort", "error")


class GenerateRequest(Message):
    KIND: ClassVar[str] = "decode.generate"

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = Field(default_factory=SamplingParams)  # the one sampling type, as is
    priority: int = 0  # higher runs first, FIFO within a priority (the engine's rule)
    # Where TokenChunks go; empty means the NATS reply subject of this request.
    reply_subject: str = ""


class TokenLogprob(WireModel):
    token_id: int
    logprob: float
    top_ids: list[int] = Field(default_factory=list)
    top_logprobs: list[float] = Field(default_factory=list)
    rank: int | None = None  # 1: the most likely token; prompt logprobs carry it (vLLM reports it)

    @classmethod
    def from_engine(cls, lp: TokenLogprobs) -> TokenLogprob:
        return cls(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_ids=[t for t, _ in lp.top],
            top_logprobs=[p for _, p in lp.top],
            rank=lp.rank,
        )

    def to_engine(self) -> TokenLogprobs:
        return TokenLogprobs(self.token_id, self.logprob, list(zip(self.top_ids, self.top_logprobs)), self.rank)


class RequestTimings(WireModel):
    """Where a finished request spent its time on the worker (seconds), for the gateway's histograms."""

    queued_s: float  # arrival on the worker -> first step that computed its tokens
    prefill_s: float  # that step -> first token
    decode_s: float  # first token -> last token


class TokenChunk(Message):
    """One streamed step of a request. The last chunk has finish_reason set."""

    KIND: ClassVar[str] = "decode.token_chunk"

    request_id: str
    seq: int  # 0, 1, 2, ... per request; gaps mean lost messages
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when requested
    # With sampling.prompt_logprobs, on the first chunk: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # one of FINISH_REASONS
    error: str | None = None  # set with finish_reason "error"
    num_cached_tokens: int | None = None  # prompt tokens served from cache; sent on the first chunk
    timings: RequestTimings | None = None  # on the last chunk of a request that ran

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CancelRequest(Message):
    """Published (fan-out) to decode and prefill cancel subjects; unknown ids are ignored."""

    KIND: ClassVar[str] = "decode.cancel"

    request_id: str
    reason: str = ""


class ReplayRequest(Message):
    """Gateway -> the decode worker streaming a request (`kvmesh.decode.replay.<worker>`, services/decode/replay.py):
    its connection dropped and came back and chunks from `from_seq` on may be lost. The answer is a stream of
    TokenChunks from `from_seq` on that carries the rest of the request too (the worker moves the request's
    stream to this reply subject), or an ErrorReply NOT_FOUND when those chunks are no longer kept."""

    KIND: ClassVar[str] = "decode.replay"

    request_id: str
    from_seq: int = Field(ge=0)  # the first TokenChunk.seq the gateway lacks
