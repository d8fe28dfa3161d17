"""Ordered delivery of what a decode worker sends: token chunks to each request's reply stream and
block events to its events subject, through one queue, so per-request order is the send order."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus
from shared.bus.stream import StreamReply
from shared.wire import Message

log = logging.getLogger(__name__)


@dataclass
class Delivery:
    stream: StreamReply | None  # None: a block event for the events subject
    span: trace.Span | None
    msg: Message
    last: bool  # ends the stream (and its span)


class Outbox:
    def __init__(self, nc: Client, events_subject: str) -> None:
        self.nc = nc
        self.events_subject = events_subject
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def put(self, d: Delivery) -> None:
        self._queue.put_nowait(d)

    async def flush(self) -> None:
        await self._queue.join()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            d = await self._queue.get()
            try:
                if d.stream is None:
                    await bus.publish(self.nc, self.events_subject, d.msg)
                    continue
                with trace.use_span(d.span, end_on_exit=False):
                    await d.stream.send(d.msg)
                    if d.last:
                        await d.stream.end()
                if d.last and d.span is not None:
                    d.span.end()
            except Exception:  # noqa: BLE001 - one broken reply subject must not stop the others
                log.exception("could not deliver to %s", getattr(d.msg, "request_id", "events"))
            finally:
                self._queue.task_done()
