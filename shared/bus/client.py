"""The calling side: typed request/reply, streamed replies, and fire-and-forget publishes."""
from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.client import Client
from opentelemetry import trace

from shared import wire
from shared.bus import headers as H
from shared.bus.chunks import send_direct, send_upload, unsubscribe_quietly
from shared.bus.errors import BusError, BusTimeout
from shared.bus.inbox import Inbox
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.stream import ReplyStream

M = TypeVar("M", bound=wire.Message)

_tracer = trace.get_tracer("kvmesh.bus")


async def request(
    nc: Client,
    subject: str,
    msg: wire.Message,
    timeout: float = 5.0,
    *,
    expect: type[M] | None = None,
    limits: BusLimits = DEFAULT_LIMITS,
) -> M:
    """Sends `msg` and returns the decoded answer.

    Raises NoRespondersError at once when nobody serves `subject`, BusTimeout after `timeout`,
    RemoteError when the answer is an ErrorReply, wire.WireError when it is not `expect`.
    """
    stream: ReplyStream[M] = await request_stream(nc, subject, msg, timeout=timeout, expect=expect, limits=limits)
    async with stream:
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout)
        except asyncio.TimeoutError:
            raise BusTimeout(subject, timeout) from None
        except StopAsyncIteration:
            raise BusError(f"{subject!r} ended its reply stream without sending anything") from None


async def request_idempotent(
    nc: Client,
    subject: str,
    msg: wire.Message,
    timeout: float = 5.0,
    *,
    expect: type[M] | None = None,
    limits: BusLimits = DEFAULT_LIMITS,
    poll_s: float = 0.05,
) -> M:
    """request() for a question that may be asked twice (tokenizing, a lookup): asked again when the
    connection reconnected while it waited. A request or its answer in flight on a server that died is
    gone (NATS does not redeliver): without this the caller waits its whole timeout for nothing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        reconnects = nc.stats["reconnects"]
        call = asyncio.ensure_future(request(nc, subject, msg, timeout=max(deadline - loop.time(), 0.001),
                                             expect=expect, limits=limits))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=poll_s)
                if done:
                    return call.result()
                if nc.stats["reconnects"] != reconnects:
                    break  # asked again below, on the connection as it is now
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        if loop.time() >= deadline:
            raise BusTimeout(subject, timeout)


async def request_stream(
    nc: Client,
    subject: str,
    msg: wire.Message,
    *,
    timeout: float = 30.0,
    expect: type[M] | None = None,
    limits: BusLimits = DEFAULT_LIMITS,
    sender: str | None = None,
) -> ReplyStream[M]:
    """Sends `msg` and returns the stream of answers; `timeout` is the idle timeout per item; `sender`: the
    answers are accepted only from it (shared/bus/sender.py; None: only from the first answer's sender).

        async with await request_stream(nc, subjects.DECODE_GENERATE, req, expect=TokenChunk) as s:
            async for chunk in s:
                ...
    """
    span = _tracer.start_span(f"request {subject}", kind=trace.SpanKind.CLIENT, attributes={"messaging.destination": subject})
    try:
        pending = {} if limits.reply_pending_msgs is None else {"pending_msgs_limit": limits.reply_pending_msgs}
        # Read through a callback buffer, not next_msg: no task and uuid per message (shared/bus/inbox.py).
        inbox = Inbox(limits.reply_pending_msgs)
        sub = await nc.subscribe(nc.new_inbox(), cb=inbox.put, **pending)
        try:
            data = wire.encode(msg)
            await send_upload(nc, subject, data, H.with_trace(None, trace.set_span_in_context(span)), sub.subject, timeout)
        except BaseException:
            await unsubscribe_quietly(sub)
            raise
    except BaseException as e:
        span.record_exception(e)
        span.set_status(trace.StatusCode.ERROR, str(e))
        span.end()
        raise
    return ReplyStream(sub, subject, timeout, expect, limits, span, sender, inbox, lambda: nc.is_closed)


async def send_request(nc: Client, subject: str, msg: wire.Message, reply: str = "", timeout: float = 5.0) -> None:
    """Sends a request without waiting for answers (they go to `reply`, e.g. a long-lived inbox).

    Safe for queue-grouped subjects: oversized messages use the upload handshake.
    """
    await send_upload(nc, subject, wire.encode(msg), H.with_trace(), reply, timeout)


async def publish(nc: Client, subject: str, msg: wire.Message) -> None:
    """Fire-and-forget to a fan-out subject or an inbox (events, load beats, cancels).

    Oversized messages are chunked straight onto `subject`, so subscribers of a chunked
    subject must not share a queue group.
    """
    await send_direct(nc, subject, wire.encode(msg), H.with_trace())
