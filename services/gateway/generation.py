"""The n choices of one request, from routing to the last token, and the request's telemetry."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from services.gateway.choice import IDLE, Choice, Delta, Idle
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, unavailable
from services.gateway.prepare import Prepared
from services.gateway.router import NoWorkerError, OverloadedError

_DONE = object()


class Generation:
    def __init__(self, ctx: GatewayContext, prepared: Prepared, span: trace.Span, arrival: float) -> None:
        self.ctx, self.prepared, self.span, self.arrival = ctx, prepared, span, arrival
        self.choices: list[Choice] = []
        self._ttft_seen = False
        self._first_token_s: float | None = None  # arrival to the first token

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)  # a batch of prompts counts each once, as vLLM

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            per_prompt[c.prompt_index] = max(per_prompt.get(c.prompt_index, 0), c.num_cached_tokens)
        return sum(per_prompt.values())

    async def open(self) -> None:
        """Routes, sends every choice and waits for each one's first chunk; on failure cancels the rest."""
        p = self.prepared
        per_prompt = len(p.samplings)
        self.choices = []
        for k, prompt in enumerate(p.prompts):
            # The routing decision as its own span: which worker, and what each cache tier holds for it.
            with self.ctx.tracer.start_as_current_span("route", context=trace.set_span_in_context(self.span),
                                                       attributes={"kvmesh.prompt_index": k}) as route_span:
                try:
                    route = self.ctx.router.pick(prompt, cache_salt=p.samplings[0].cache_salt,
                                                 lora=self.ctx.loras.route_key(p.samplings[0].lora_name))
                except NoWorkerError:
                    raise unavailable("no decode worker is alive", code="no_decode_worker") from None
                except OverloadedError as e:
                    raise unavailable(str(e), code="overloaded") from None
                route_span.set_attributes({"kvmesh.decode.worker": route.worker_id,
                                           "kvmesh.route.cached_blocks": route.cached_blocks,
                                           "kvmesh.route.host_blocks": route.host_blocks,
                                           "kvmesh.route.kvstore_blocks": route.kvstore_blocks})
            if k == 0:
                self.span.set_attribute("kvmesh.decode.worker", route.worker_id)
                self.span.set_attribute("kvmesh.route.cached_blocks", route.cached_blocks)
                self.span.set_attribute("kvmesh.route.host_blocks", route.host_blocks)
                self.span.set_attribute("kvmesh.route.kvstore_blocks", route.kvstore_blocks)
            for j, s in enumerate(p.samplings):
                i = k * per_prompt + j
                self.choices.append(Choice(self.ctx, f"{p.request_id}-{i}", i, prompt, s, p.priority, p.stops,
                                           route.worker_id, self.span, prompt_index=k, stop_regex=p.stop_regex,
                                           streaming=p.stream))
        self.ctx.metrics.prompt_tokens.labels(self.ctx.metrics.model).inc(self.prompt_tokens)
        queue = self.ctx.model.queue
        token, started = queue.enter(), False
        try:
            results = await self._open_choices()
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                self.abort("a sibling choice failed")
                raise errors[0]
            started = True
        finally:
            queue.leave(token, started)

    async def _open_choices(self) -> list[object]:
        """Every choice's open(), each result or exception; within --max-queue-wait of the request's arrival
        (services/gateway/queue_wait.py): past it the choices are given up in the workers (their blocks freed,
        nothing left queued for a client that is gone) and the request is answered 503 with Retry-After."""
        opening = asyncio.ensure_future(asyncio.gather(*(c.open() for c in self.choices), return_exceptions=True))
        bound = self.ctx.config.max_queue_wait_s
        if not bound:
            return await opening
        try:
            return await asyncio.wait_for(asyncio.shield(opening),
                                          max(bound - (time.monotonic() - self.arrival), 0.0))
        except asyncio.TimeoutError:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            self.abort("not started within --max-queue-wait")
            queue = self.ctx.model.queue
            retry_s = self.ctx.retry.for_wait(max(queue.expected_wait_s() - bound, 1.0))
            raise APIError(503, f"the mesh did not start this request within {bound:g}s (--max-queue-wait: "
                                f"{queue.waiting} requests wait for their first token); retry in {retry_s:.1f}s",
                           code="queue_timeout", headers=self.ctx.retry.headers(retry_s)) from None
        except BaseException:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            raise

    async def deltas(self, idle_marks: bool = False) -> AsyncIterator[Delta | Idle]:
        """Deltas of every choice as they come (choices interleave; each one's deltas stay in order).
        idle_marks: also IDLE whenever the next delta needs a wait (services/gateway/streaming.py sends what it
        holds then, so deltas that arrived together go out in one write and a lone one is never held)."""
        if len(self.choices) == 1:
            async for d in self.choices[0].deltas(idle_marks):
                if d is not IDLE:
                    self._observe(d)  # type: ignore[arg-type]
                yield d
            return
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for d in choice.deltas():
                    await queue.put(d)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put(e)
            finally:
                await queue.put(_DONE)

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                if idle_marks and queue.empty():
                    yield IDLE
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, Delta)
                    self._observe(item)
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def _observe(self, d: Delta) -> None:
        if d.token_ids and not self._ttft_seen:
            self._ttft_seen = True
            ttft = self._first_token_s = time.monotonic() - self.arrival
            self.ctx.metrics.ttft.labels(self.ctx.metrics.model).observe(ttft)
            self.span.set_attribute("gen_ai.response.time_to_first_token", ttft)
            self.span.add_event("first_token")

    def abort(self, reason: str) -> None:
        """Cancels every choice still running in the workers (client gone, error, sibling failed)."""
        for c in self.choices:
            c.cancel_soon(reason)

    async def close(self) -> None:
        """Releases every reply inbox (idempotent)."""
        for c in self.choices:
            await c.close()

    def finish(self) -> None:
        """Records the request's usage on its span and its latency, once it is over (any outcome)."""
        self.span.set_attribute("gen_ai.usage.input_tokens", self.prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if self.choices and all(c.finished for c in self.choices):
            e2e = time.monotonic() - self.arrival
            self.ctx.metrics.e2e.labels(self.ctx.metrics.model).observe(e2e)
            ttft = self._first_token_s
            per_prompt = [[c.num_tokens for c in self.choices if c.prompt_index == k] for k in range(len(self.prepared.prompts))]
            self.ctx.metrics.request_done(per_prompt, ttft, e2e)
            reasons = [c.finish_reason or "" for c in self.choices]
            self.span.set_attribute("gen_ai.response.finish_reasons", reasons)
        elif self.choices:
            for c in self.choices:
                if not c.finished:
                    self.ctx.metrics.finished("abort")


def as_api_error(e: BaseException) -> APIError:
    return e if isinstance(e, APIError) else APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal")
