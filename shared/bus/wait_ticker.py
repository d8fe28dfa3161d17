"""One timer per event loop for every reply stream that waits with a watch (ReplyStream.watch), instead of a
future, a timer and a wake-up of the waiting task per stream every watch interval.

Why: the gateway's streams watch their worker every 0.25 s while they wait for the next token
(services/gateway/choice.py). At 2,000 streams of a slow simulated mesh (a token every ~2 s) that was 8,000
wake-ups a second whatever the token rate: each a future, a timer in a heap of thousands, a task step through
the stream's read loop and the check. A cProfile of the gateway at 2,000 streams counted ~1 million
waits for ~18,000 tokens, and the gateway spent ~2 ms of CPU per streamed token against ~0.3 at 500 streams.

Here the waiting stream parks one future with its deadline and its check; one periodic tick (only while anything
waits) calls the checks of the streams that have waited at least one interval (as before: a stream that hears
from its worker more often than that is never checked) and ends the waits past their deadline. A check that
raises fails that stream's wait with its exception, in the waiting task, as the check raised there before.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

Check = Callable[[], None]


@dataclass(slots=True)
class _Wait:
    future: asyncio.Future[None]
    check: Check
    since: float  # when the wait started (monotonic)
    deadline: float  # when it ends with nothing (the stream's idle timeout)


class WaitTicker:
    """The streams of one event loop that wait with a watch of `interval` seconds."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._waits: dict[int, _Wait] = {}
        self._handle: asyncio.TimerHandle | None = None

    async def wait(self, future: asyncio.Future[None], check: Check, timeout: float) -> None:
        """Until `future` is done: the caller's inbox got a message, `check` raised (the future fails with its
        exception, raised here), or `timeout` passed (the tick resolves it; the caller finds its deadline passed:
        up to one interval late). `check` runs on the ticker's clock once the wait has lasted `interval`, then
        each tick."""
        now = time.monotonic()
        key = id(future)
        self._waits[key] = _Wait(future, check, now, now + timeout)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(min(self._interval, max(0.0, timeout)), self._tick)
        try:
            await future
        finally:
            self._waits.pop(key, None)

    def _tick(self) -> None:
        self._handle = None
        now = time.monotonic()
        for w in list(self._waits.values()):
            if w.future.done():
                continue
            if now >= w.deadline:
                w.future.set_result(None)  # the caller finds its deadline passed
                continue
            if now - w.since >= self._interval:
                try:
                    w.check()
                except Exception as e:  # noqa: BLE001 - the stream's own verdict, raised in its task
                    w.future.set_exception(e)
        if self._waits:
            self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)


_TICKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, WaitTicker]] = weakref.WeakKeyDictionary()


def ticker(interval: float) -> WaitTicker:
    """The running loop's ticker for this interval (one per loop and interval, made on first use)."""
    per_loop = _TICKERS.setdefault(asyncio.get_running_loop(), {})
    t = per_loop.get(interval)
    if t is None:
        t = per_loop[interval] = WaitTicker(interval)
    return t
