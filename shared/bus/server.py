"""The serving side: decode, dispatch to a typed handler, answer; never die of a bad message.

A handler is `handler(msg, ctx)` and may be
  * a coroutine returning a Message (one reply), None (no reply, e.g. it keeps
    `ctx.stream()` to answer later from another task), or an async iterator of Messages;
  * an async generator (each yielded Message is one streamed item).
Raising RemoteError(code, message) answers with that ErrorReply; any other exception answers
ErrorReply("internal", ...). Returning an ErrorReply sends it as is.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace

from shared import wire
from shared.bus import headers as H
from shared.bus.chunks import Envelope, Reassembler, receive_upload, send_direct, unsubscribe_quietly
from shared.bus.errors import BusError, RemoteError
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.stream import StreamReply
from shared.bus import error_reply as codes
from shared.bus.error_reply import ErrorReply

M = TypeVar("M", bound=wire.Message)
log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.bus")

Reply = Union[wire.Message, AsyncIterator[wire.Message], None]
Handler = Callable[[M, "RequestContext"], Union[Awaitable[Reply], AsyncIterator[wire.Message]]]
EventHandler = Callable[[M, "RequestContext"], Awaitable[None]]


@dataclass
class RequestContext:
    """What a handler knows about the message besides its body."""

    nc: Client
    subject: str
    reply: str  # empty for fire-and-forget messages
    headers: dict[str, str] = field(default_factory=dict)

    def stream(self) -> StreamReply:
        """A stream to the caller; carries the current (handler's) trace context."""
        return StreamReply(self.nc, self.reply)

    async def respond(self, msg: wire.Message) -> None:
        if not self.reply:
            raise BusError(f"message on {self.subject!r} has no reply subject")
        await send_direct(self.nc, self.reply, wire.encode(msg), H.with_trace())


class Dispatcher(Generic[M]):
    """Turns raw NATS messages into handler calls, one task each, at most `max_inflight`."""

    def __init__(self, nc: Client, subject: str, handler: Handler[M], msg_type: type[M], limits: BusLimits = DEFAULT_LIMITS) -> None:
        self.nc, self.subject, self.handler, self.msg_type, self.limits = nc, subject, handler, msg_type, limits
        self._direct = Reassembler(limits)  # direct-framed chunks (fan-out subjects)
        self._tasks: set[asyncio.Task[None]] = set()

    async def on_message(self, msg: Msg) -> None:
        """Subscription callback: returns quickly so the subscription keeps draining."""
        hdrs = msg.headers or {}
        try:
            if H.UPLOAD in hdrs and H.CHUNK in hdrs:  # the requester waits on the handshake inbox (msg.reply)
                work, reply = self._handle_upload(msg), msg.reply
            else:
                env = self._direct.feed(msg)  # here, not in a task: chunks must be fed in arrival order
                if env is None:
                    return
                work, reply = self._handle(env), env.reply
        except BusError as e:
            log.warning("dropping message on %s: %s", self.subject, e)
            return
        if len(self._tasks) >= self.limits.max_inflight:
            work.close()
            await self._answer_error(reply or msg.reply, codes.OVERLOADED, f"{self.subject}: too many requests in flight")
            return
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug in the bus itself: log, keep serving
            log.error("request task on %s failed", self.subject, exc_info=task.exception())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle_upload(self, first: Msg) -> None:
        try:
            env = await receive_upload(self.nc, first, self.limits)
        except (BusError, nats.errors.Error) as e:
            log.warning("bad upload on %s: %s", self.subject, e)
            # The caller waits on the handshake inbox or, once it has sent every chunk, on its reply inbox: the
            # NATS reply its chunks came with (never a subject named in a header).
            for reply in {first.reply, getattr(e, "reply", "")} - {""}:
                await self._answer_error(reply, codes.BAD_REQUEST, str(e))
            return
        await self._handle(env)

    async def _handle(self, env: Envelope) -> None:
        with _tracer.start_as_current_span(
            f"serve {self.subject}", context=H.trace_context(env.headers), kind=trace.SpanKind.SERVER
        ) as span:
            try:
                request = wire.decode(env.data, self.msg_type)
            except wire.WireError as e:
                log.warning("bad message on %s: %s", self.subject, e)
                span.set_status(trace.StatusCode.ERROR, str(e))
                await self._answer_error(env.reply, codes.BAD_REQUEST, str(e))
                return
            await self._run(request, RequestContext(self.nc, env.subject, env.reply, env.headers), span)

    async def _run(self, request: M, ctx: RequestContext, span: trace.Span) -> None:
        stream: StreamReply | None = None
        try:
            result: Any = self.handler(request, ctx)
            if inspect.isawaitable(result):
                result = await result
            if result is None:
                return
            if isinstance(result, wire.Message):
                if ctx.reply:
                    await ctx.respond(result)
                return
            stream = ctx.stream()
            async for item in result:
                await stream.send(item)
            await stream.end()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            code, text = (e.code, e.message) if isinstance(e, RemoteError) else (codes.INTERNAL, f"{type(e).__name__}: {e}")
            if not isinstance(e, RemoteError):
                log.exception("handler for %s failed", self.subject)
            span.record_exception(e)
            span.set_status(trace.StatusCode.ERROR, text)
            if stream is not None:
                try:
                    await stream.end(ErrorReply(code=code, message=text))
                except Exception as send_error:
                    log.warning("could not end the stream on %s: %s", self.subject, send_error)
            else:
                await self._answer_error(ctx.reply, code, text)

    async def _answer_error(self, reply: str, code: str, message: str) -> None:
        if not reply:
            return
        try:
            await send_direct(self.nc, reply, wire.encode(ErrorReply(code=code, message=message)), H.with_trace())
        except Exception as e:  # e.g. a hostile, invalid reply subject: log it, keep serving
            log.warning("could not answer %s on %r: %s", code, reply, e)


@dataclass
class Served:
    """A served subject; `stop()` unsubscribes and cancels handlers still running."""

    subject: str
    queue: str | None
    subscription: Subscription
    dispatcher: Dispatcher[Any]

    async def stop(self) -> None:
        await unsubscribe_quietly(self.subscription)
        await self.dispatcher.stop()


async def serve(
    nc: Client,
    subject: str,
    queue: str | None,
    handler: Handler[M],
    msg_type: type[M],
    *,
    limits: BusLimits = DEFAULT_LIMITS,
) -> Served:
    """Serves `subject` (load balanced across `queue`'s members; None: every subscriber gets all)."""
    dispatcher = Dispatcher(nc, subject, handler, msg_type, limits)
    sub = await nc.subscribe(subject, queue=queue or "", cb=dispatcher.on_message)
    return Served(subject, queue, sub, dispatcher)


async def subscribe(
    nc: Client,
    subject: str,
    handler: EventHandler[M],
    msg_type: type[M] | tuple[type[wire.Message], ...],
    *,
    queue: str | None = None,
    limits: BusLimits = DEFAULT_LIMITS,
    traced: bool = True,
    max_bytes: int | None = None,
) -> Subscription:
    """Consumes fan-out messages (events, load beats, cancels) one at a time, in arrival order.

    Bad messages and handler errors are logged and skipped; nothing is answered.

    A message that carries a trace context (a cancel sent for a request) is handled in a consumer span of that
    trace. One without (a load beat, a block event: published by a worker's own loop, in no request) gets no
    span: it would be a trace of its own for every beat of every worker, which at 64 workers is most of what a
    trace backend receives and a good part of the gateway's CPU. traced=False: no span even when the message
    carries a context (the gateway's beats and block events, whoever sent them: they are mesh state, not a
    request's work).

    max_bytes: messages on this subject are single NATS messages of at most this many bytes (beats, block
    events: shared/bus/limits.py); a chunked or larger one is dropped before it is decoded.
    """
    assembler = Reassembler(limits)

    async def on_message(msg: Msg) -> None:
        if max_bytes is not None and (len(msg.data) > max_bytes or H.CHUNK in (msg.headers or {})):
            log.warning("dropping a %d-byte%s message on %s (at most %d bytes, never chunked)", len(msg.data),
                        " chunk of a" if H.CHUNK in (msg.headers or {}) else "", msg.subject, max_bytes)
            return
        try:
            env = assembler.feed(msg)
            if env is None:
                return
            event = wire.decode(env.data, msg_type)
        except (BusError, wire.WireError) as e:
            log.warning("bad message on %s: %s", msg.subject, e)
            return
        parent = H.trace_context(env.headers) if traced and env.headers and H.TRACEPARENT in env.headers else None
        if parent is None:
            try:
                await handler(event, RequestContext(nc, env.subject, env.reply, env.headers))
            except Exception:
                log.exception("handler for %s failed", msg.subject)
            return
        with _tracer.start_as_current_span(f"receive {subject}", context=parent, kind=trace.SpanKind.CONSUMER):
            try:
                await handler(event, RequestContext(nc, env.subject, env.reply, env.headers))
            except Exception:
                log.exception("handler for %s failed", msg.subject)

    return await nc.subscribe(subject, queue=queue or "", cb=on_message)
