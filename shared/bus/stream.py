"""Streamed replies: many ordered messages to one reply inbox, then an end marker.

Item k carries `Kvmesh-Seq: k`; the stream ends with a message carrying `Kvmesh-End: <count>`
whose body is empty or an encoded ErrorReply. Items may be chunked (direct framing); the
sender sends one item at a time so chunks of different items never interleave. The receiver
checks the sequence, so a lost message (slow consumer) raises instead of silently dropping
tokens. A reply without `Kvmesh-Seq` (a plain request/reply answer) is a one-item stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context
from opentelemetry import trace

from shared import wire
from shared.bus import headers as H
from shared.bus.chunks import Envelope, Reassembler, send_direct, unsubscribe_quietly
from shared.bus import slow_consumer
from shared.bus.errors import BusError, BusTimeout, MessagesDroppedError, NoRespondersError, RemoteError, StreamGapError
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.error_reply import ErrorReply
from shared.bus import wait_ticker
from shared.bus.inbox import Inbox

M = TypeVar("M", bound=wire.Message)
log = logging.getLogger(__name__)


class StreamReply:
    """The sending side. Captures the trace context it was created in, for every item."""

    def __init__(self, nc: Client, subject: str, ctx: otel_context.Context | None = None) -> None:
        if not subject:
            raise BusError("cannot stream a reply: the request has no reply subject")
        self.subject = subject
        self._nc = nc
        # The stream's trace context never changes: inject it once, not for every item (the propagators' inject
        # was the largest single cost of a decode worker's per-token send).
        self._trace = H.with_trace(None, ctx if ctx is not None else otel_context.get_current())
        self._lock = asyncio.Lock()
        self._seq = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def count(self) -> int:
        return self._seq

    async def send(self, msg: wire.Message) -> None:
        data = wire.encode(msg)
        async with self._lock:
            if self._closed:
                raise BusError(f"stream to {self.subject!r} already ended")
            await send_direct(self._nc, self.subject, data, {H.SEQ: str(self._seq), **self._trace})
            self._seq += 1

    async def end(self, error: ErrorReply | None = None) -> None:
        """Sends the end marker; idempotent, so every exit path may call it."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            body = wire.encode(error) if error is not None else b""
            await send_direct(self._nc, self.subject, body, {H.END: str(self._seq), **self._trace})


class ReplyStream(Generic[M]):
    """The receiving side, over a private inbox subscription: `async for msg in stream`.

    Closes its subscription when the stream ends or fails; use `async with` (or `aclose()`)
    to release it when leaving early. Raises NoRespondersError, BusTimeout (nothing arrived
    for `idle_timeout` seconds), RemoteError, StreamGapError, MessagesDroppedError (this receiver fell behind
    and the client library dropped messages), ChunkError or wire.WireError.
    """

    def __init__(
        self,
        sub: Subscription,
        target: str,
        idle_timeout: float,
        expect: type[M] | None = None,
        limits: BusLimits = DEFAULT_LIMITS,
        span: trace.Span | None = None,
        sender: str | None = None,
        inbox: Inbox | None = None,
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        """sender: accept messages only from this sender (shared/bus/sender.py); None: from the sender of
        the first message, whoever it is (a request to a queue group may reach any member). inbox: the
        subscription's callback buffer (shared/bus/inbox.py; request_stream subscribes so); None: read with
        nats-py's next_msg. closed: whether the connection is closed for good (a wait on an inbox then ends)."""
        self._sub = sub
        self._inbox = inbox
        self._conn_closed = closed
        self._sender = sender
        self._target = target
        self._idle_timeout = idle_timeout
        self._expect = expect
        self._assembler = Reassembler(limits)
        self._span = span
        self._seq = 0
        self._done = False  # no more items will be returned
        self._closed = False  # subscription and span released
        self._watch: Callable[[], None] | None = None
        self._watch_interval = 0.0

    def watch(self, check: Callable[[], None], interval: float) -> None:
        """Calls `check` every `interval` seconds while this stream waits for a message, from the waiting task;
        what it raises ends the stream. (The gateway checks that the worker still beats: services/gateway/
        token_stream.py. A watcher task beside every wait cost a task and a timer per streamed token.)"""
        self._watch, self._watch_interval = check, interval

    @property
    def ready(self) -> bool:
        """A message of this stream has arrived and waits to be read: the next item may need no wait (it does
        when that message is one chunk of several). The gateway sends what is ready in one write."""
        if self._done:
            return False
        return bool(self._inbox.msgs) if self._inbox is not None else self._sub.pending_msgs > 0

    @property
    def inbox(self) -> str:
        return self._sub.subject

    @property
    def dropped(self) -> bool:
        """The client library dropped messages of this stream: its reader fell behind (slow consumer)."""
        return slow_consumer.dropped(self._sub) or (self._inbox is not None and self._inbox.overflowed)

    def __aiter__(self) -> AsyncIterator[M]:
        return self

    async def __anext__(self) -> M:
        if self._done:
            await self._finish(None)
            raise StopAsyncIteration
        try:
            item = await self._next_item()
        except BaseException as e:
            await self._finish(e)
            raise
        if item is None:
            await self._finish(None)
            raise StopAsyncIteration
        return item

    async def __aenter__(self) -> ReplyStream[M]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._finish(None)

    async def _next_item(self) -> M | None:
        env = await self._next_envelope()
        hdrs = env.headers
        if H.END in hdrs:
            if hdrs[H.END] != str(self._seq):
                raise StreamGapError(f"stream from {self._target!r} ended after {hdrs[H.END]} items, got {self._seq}")
            if env.data:
                self._raise_remote(wire.decode(env.data, ErrorReply))
            return None
        seq = hdrs.get(H.SEQ)
        if seq is None:
            self._done = True  # a plain reply: the whole "stream"
        elif seq != str(self._seq):
            raise StreamGapError(f"stream from {self._target!r}: expected item {self._seq}, got {seq!r}")
        self._seq += 1
        expect = (self._expect, ErrorReply) if self._expect is not None else None
        msg = wire.decode(env.data, expect)
        if isinstance(msg, ErrorReply) and self._expect is not ErrorReply:
            self._raise_remote(msg)
        return msg  # type: ignore[return-value]

    async def _next_envelope(self) -> Envelope:
        deadline = time.monotonic() + self._idle_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusTimeout(self._target, self._idle_timeout)
            if self.dropped:
                # Checked per message. Dropped messages may include the end marker, so a caller that must not
                # wait its whole idle timeout checks `dropped` while it waits (services/gateway/token_stream.py).
                raise MessagesDroppedError(f"stream from {self._target!r}: this receiver fell behind and messages "
                                           f"were dropped (slow consumer) after item {self._seq}")
            # A watched wait on an inbox is checked by the loop's shared ticker (no wake-up of its own: _next_msg);
            # otherwise it wakes every watch interval to check.
            ticked = self._watch is not None and self._inbox is not None
            wait = remaining if self._watch is None or ticked else min(remaining, self._watch_interval)
            msg = await self._next_msg(wait)
            if msg is None:
                if self._watch is not None and not ticked:
                    self._watch()
                continue
            hdrs = msg.headers or {}
            if hdrs.get(H.STATUS) == "503":  # the server's own answer
                raise NoRespondersError(self._target)
            if self._sender is None:
                self._sender = hdrs.get(H.FROM)
            elif hdrs.get(H.FROM) != self._sender:
                log.warning("ignoring a message on the stream from %r: it is not from %r", self._target, self._sender)
                continue
            env = self._assembler.feed(msg)
            if env is not None:
                return env

    async def _next_msg(self, wait: float) -> Msg | None:
        """The next message, or None after `wait` seconds."""
        inbox = self._inbox
        if inbox is None:
            try:
                return await self._sub.next_msg(timeout=wait)
            except nats.errors.TimeoutError:
                return None
        if not inbox.msgs:
            if self._conn_closed():
                raise nats.errors.ConnectionClosedError
            if self._watch is not None:
                if not await inbox.wait_watched(wait_ticker.ticker(self._watch_interval), self._watched, wait):
                    return None
            elif not await inbox.wait(wait):
                return None
        return inbox.msgs.popleft()

    def _watched(self) -> None:
        """The watch, and the closed connection a wait notices (on the ticker's clock while it waits)."""
        if self._conn_closed():
            raise nats.errors.ConnectionClosedError
        self._watch()  # type: ignore[misc]

    def _raise_remote(self, err: ErrorReply) -> None:
        raise RemoteError(err.code, err.message, self._target)

    async def _finish(self, error: BaseException | None) -> None:
        self._done = True
        if self._closed:
            return
        self._closed = True
        await unsubscribe_quietly(self._sub)
        if self._span is not None:
            if error is not None and not isinstance(error, (StopAsyncIteration, GeneratorExit)):
                self._span.record_exception(error)
                self._span.set_status(trace.StatusCode.ERROR, str(error))
            self._span.end()
            self._span = None


def stream_reply(nc: Client, reply_subject: str) -> StreamReply:
    """A StreamReply to `reply_subject` in the current trace context (see RequestContext.stream)."""
    return StreamReply(nc, reply_subject)
