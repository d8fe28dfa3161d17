"""Counting the requests a service is answering, so that drain() can wait for them.

The bus dispatcher sends a handler's reply after the handler returns, and stopping a served
endpoint cancels its tasks; a request counted as done before its reply went out could lose
that reply on shutdown. So a tracked handler sends its own reply (or error reply) and only then
counts as done.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from shared import bus, wire
from shared.protocol.errors import ErrorReply

M = TypeVar("M", bound=wire.Message)
Handler = Callable[[M, bus.RequestContext], Awaitable[wire.Message]]


class InFlight:
    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return self._count

    def track(self, handler: Handler[M]) -> Callable[[M, bus.RequestContext], Awaitable[None]]:
        """`handler` returns its reply or raises RemoteError; other exceptions stay the bus's to answer."""

        async def tracked(msg: M, ctx: bus.RequestContext) -> None:
            self._count += 1
            self._idle.clear()
            try:
                try:
                    reply = await handler(msg, ctx)
                except bus.RemoteError as e:
                    trace.get_current_span().set_status(trace.StatusCode.ERROR, e.message)
                    reply = ErrorReply(code=e.code, message=e.message)
                if ctx.reply:
                    await ctx.respond(reply)
            finally:
                self._count -= 1
                if not self._count:
                    self._idle.set()

        return tracked

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight; False if something still is after `timeout` seconds."""
        await asyncio.sleep(0)  # let tasks the dispatcher has just created start and count themselves
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class MicroServiceDrain:
    """The drain hooks of a service that is one nats.micro service answering tracked requests (the
    tokenizer, the kvstore): unsubscribe first, let delivered requests finish, then stop the service."""

    _micro: bus.MicroService | None
    _inflight: InFlight

    async def stop_intake(self) -> None:
        if self._micro is not None:
            await self._micro.service.stop()  # unsubscribe: no new work; delivered messages still run

    def in_flight(self) -> int:
        return self._inflight.count

    async def release(self, remaining_s: float) -> None:
        if self._micro is not None:
            await self._micro.stop()  # cancels whatever is left
            self._micro = None
