"""A reply inbox's messages, handed over by its subscription's callback and read by one waiting task.

nats-py's `next_msg` starts a task, a `wait_for` and a uuid for every message it returns: for a gateway that reads
one token stream per request, most of what a streamed token cost it on the bus side. Subscribed with
this as the callback (nats-py's public API), the subscription hands each message over in order, and the reader
takes it from a deque, waiting on one future (with one timer) only when the deque is empty.

Falling behind: nats-py still applies the subscription's pending limits to its own queue (a stall of the event
loop lets it fill) and reports what it drops (shared/bus/slow_consumer.py); this buffer holds at most the same
number of messages and, past it, drops and says so (`overflowed`), so a reader that falls behind learns it
either way.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from nats.aio.msg import Msg

from shared.bus.wait_ticker import WaitTicker


class Inbox:
    def __init__(self, limit: int | None = None) -> None:
        self.msgs: deque[Msg] = deque()
        self.limit = limit
        self.overflowed = False  # messages were dropped: the reader fell behind
        self._waiter: asyncio.Future[None] | None = None

    async def put(self, msg: Msg) -> None:
        """The subscription's callback: one message, in arrival order."""
        if self.limit is not None and len(self.msgs) >= self.limit:
            self.overflowed = True
            return
        self.msgs.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> bool:
        """Until a message is there (True) or `timeout` seconds passed (False). One reader at a time."""
        if self.msgs:
            return True
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self.msgs)

    async def wait_watched(self, ticker: WaitTicker, check: Callable[[], None], timeout: float) -> bool:
        """As wait, with `check` called on the loop's shared ticker while it waits (shared/bus/wait_ticker.py): no
        timer of its own, and no wake-up of the reader unless a message came, the check raised or time is up."""
        if self.msgs:
            return True
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await ticker.wait(waiter, check, timeout)
        finally:
            self._waiter = None
        return bool(self.msgs)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
