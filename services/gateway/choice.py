"""One choice of a request: the text its token stream becomes. The chunks come from a TokenStream
(services/gateway/token_stream.py), which keeps them coming across worker loss and reconnects; here they are
detokenized incrementally, cut at stop strings, and turned into deltas with their logprobs."""
from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry import trace

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, unavailable
from services.gateway.special_tokens import output_detokenizer
from services.gateway.stop import StopMatcher
from services.gateway.token_stream import IDLE, Idle, TokenStream
from shared.protocol.generate import TokenChunk, TokenLogprob
from shared.sampling_params import SamplingParams

__all__ = ["IDLE", "Choice", "Delta", "Idle"]


@dataclass
class Delta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when requested
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended the choice
    matched_stop: str | int | None = None  # SGLang's: the same, or the eos token id (None on length)


class Choice:
    def __init__(self, ctx: GatewayContext, request_id: str, index: int, prompt: list[int], sampling: SamplingParams,
                 priority: int, stops: list[str], worker_id: str | None, span: trace.Span, prompt_index: int = 0,
                 stop_regex: list[re.Pattern[str]] = (), streaming: bool = True) -> None:
        self.ctx, self.index, self.span = ctx, index, span
        self.prompt_index = prompt_index
        self.stream = TokenStream(ctx, request_id, prompt, sampling, priority, worker_id, span)
        self._origin = self.stream.origin  # the request as the client asked it
        self._generated = self.stream.generated  # every token output so far, across migrations
        self._detok = output_detokenizer(ctx.tokenizer, prompt, sampling, ctx.added_tokens)
        self._stop = StopMatcher(stops, include_stop=sampling.include_stop_str_in_output, regexes=stop_regex,
                                 streaming=streaming)
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self._last_chunk_time = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def open(self) -> None:
        """Sends the request and waits for the first chunk, so refusals become HTTP statuses."""
        await self.stream.open()

    async def deltas(self, idle_marks: bool = False) -> AsyncIterator[Delta | Idle]:
        """The choice's deltas in order. idle_marks: also IDLE each time the next read would wait (nothing of
        this stream has arrived yet) or a migration starts, so a streaming caller sends what it holds then."""
        async with aclosing(self.stream.chunks(idle_marks)) as chunks:
            async for chunk in chunks:
                if chunk is IDLE:
                    yield IDLE
                    continue
                delta = self._on_chunk(chunk)
                if delta is not None:
                    yield delta
                if self.finished:
                    return

    def _on_chunk(self, chunk: TokenChunk) -> Delta | None:
        m = self.ctx.metrics
        now = time.monotonic()
        if chunk.num_cached_tokens is not None and not self.stream.migrations:
            self.num_cached_tokens = chunk.num_cached_tokens
            m.prefix_lookup(len(self._origin.prompt_token_ids), chunk.num_cached_tokens)
        if chunk.finish_reason == "error":
            raise APIError(500, f"generation failed: {chunk.error or 'unknown error'}", code="generation_error")
        if chunk.finish_reason == "abort":
            raise unavailable("the decode worker aborted the request", code="aborted")
        delta = Delta(self.index, prompt_logprobs=chunk.prompt_logprobs)
        if chunk.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            else:
                m.inter_token(now - self._last_chunk_time)
            self._last_chunk_time = now
            ids, lps = list(chunk.token_ids), list(chunk.logprobs or [])
            n_text = len(ids)
            if chunk.finish_reason == "stop" and not self._origin.sampling.include_stop_str_in_output:
                # The engine ended on a stop token (a stop_token_id, eos, or a grammar's end): its text is
                # not output unless asked (vLLM); its id still counts and is reported.
                n_text -= 1
            # Stop strings count only once the output is longer than min_tokens (vLLM's rule).
            min_tokens, before = self._origin.sampling.min_tokens, len(self._generated)
            if len(ids) > 1 and self._stop.active:
                # Several tokens at once (a speculative verify step): cut them where a stop string ends, so the
                # tokens, logprobs and usage are those of decoding one token at a time.
                delta.text = ""
                for n, token in enumerate(ids, 1):
                    if n <= n_text:
                        delta.text += self._stop.push(self._detok.push([token]), armed=before + n > min_tokens)
                    if self._stop.stopped:
                        ids, lps = ids[:n], lps[:n]
                        break
            else:
                delta.text = self._stop.push(self._detok.push(ids[:n_text]), armed=before + len(ids) > min_tokens)
            self.num_tokens += len(ids)
            self.stream.keep(ids)
            m.model_generation_tokens.inc(len(ids))
            delta.token_ids = ids
            delta.logprobs = lps
        if self._stop.stopped:
            self.finish_reason, delta.stop_reason = "stop", self._stop.matched
            self.cancel_soon("stop string")  # the workers would otherwise run on to max_tokens
        elif chunk.finished:
            delta.text += self._stop.push(self._detok.flush(),
                                          armed=len(self._generated) > self._origin.sampling.min_tokens)
            if self._stop.stopped:
                self.finish_reason, delta.stop_reason = "stop", self._stop.matched
            else:
                delta.text += self._stop.flush()
                self.finish_reason = chunk.finish_reason
                if chunk.finish_reason == "stop" and self._generated:
                    # The engine ended on a stop token: one the request named, or eos (the last token either way).
                    last = self._generated[-1]
                    delta.matched_stop = last
                    delta.stop_reason = last if last in self._origin.sampling.stop_token_ids else None
        if delta.stop_reason is not None and isinstance(delta.stop_reason, str):
            delta.matched_stop = delta.stop_reason
        if self.finished:
            delta.finish_reason = self.finish_reason
            m.finished(self.finish_reason or "stop")
            m.choice_done(len(self._origin.prompt_token_ids), self.num_tokens, self._origin.sampling.max_tokens,
                          chunk.timings)
        if not delta.text and not delta.token_ids and not delta.finish_reason and delta.prompt_logprobs is None:
            return None
        return delta

    async def close(self) -> None:
        await self.stream.close()

    def cancel_soon(self, reason: str) -> None:
        """Tells every worker to drop this choice, at most once, from a task that outlives the request."""
        self.stream.cancel_soon(reason)
