"""How far behind its own NATS input the gateway is: the round trip of a probe it sends itself.

Token chunks, load beats and block events all reach the gateway through one socket and one event loop. When it
is asked for more than its CPU carries, the backlog builds in the socket and in nats-server's buffer for the
connection (up to the point where the server cuts it off as a slow consumer), where no event-loop lag probe sees
it. A tiny message the gateway publishes to its own inbox queues behind exactly that backlog, so its
round trip is the gateway's input lag. Admission (services/gateway/overload.py) refuses new requests while it
is above a bound: the gateway sheds load before workers look dead and streams stall, whatever the machine.

One probe is out at a time: the lag is the last round trip, or the age of the probe still out (or how late the
next one is to go out) when that is longer, so a backlog that keeps growing shows at once. Until a first probe has come back nothing is known (a
server that does not let the gateway publish to its own inbox must not make it refuse everything).

The bound is judged against the machine's floor (`limit`): admission refuses while the lag is above
max(--max-input-lag, FLOOR_FACTOR x the smallest round trip of the last FLOOR_WINDOW_S). On a small busy machine
(the gateway sharing 2 cores with its engines) the probe's round trip includes the time other processes hold the
cores, even when the gateway is not behind at all; the smallest recent round trip is that cost, and a backlog of
the gateway's own adds to it. A lag several times the floor is a backlog; one near it is the machine. While the
gateway refuses, its own load stops growing, so a lag that stays high for the whole window anyway raises the
floor (and the limit) with it: load the gateway cannot shed by refusing is no reason to refuse everyone. A stall
or a growing backlog still shows at once, because the floor is the window's smallest trip, not its typical one.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

PERIOD_S = 0.1  # between a probe's return and the next one
RECHECK_S = 0.25  # while a probe is out: how often to check whether the connection dropped meanwhile
FLOOR_WINDOW_S = 30.0  # the floor is the smallest round trip this recent
FLOOR_FACTOR = 3.0  # a lag this many times the floor is a backlog, not the machine


class LagFloor:
    """The smallest probe round trip of the last `window_s` seconds (monotonic deque: O(1) per trip)."""

    def __init__(self, window_s: float = FLOOR_WINDOW_S) -> None:
        self._window_s = window_s
        self._trips: deque[tuple[float, float]] = deque()  # (when, round trip), round trips increasing

    def note(self, trip_s: float, now: float) -> None:
        while self._trips and self._trips[-1][1] >= trip_s:
            self._trips.pop()  # never the minimum again: a smaller, later trip outlives it
        self._trips.append((now, trip_s))
        self._expire(now)

    def seconds(self, now: float) -> float:
        self._expire(now)
        return self._trips[0][1] if self._trips else 0.0

    def _expire(self, now: float) -> None:
        while self._trips and self._trips[0][0] < now - self._window_s:
            self._trips.popleft()


class InputLag:
    def __init__(self, nc: Client, period_s: float = PERIOD_S, floor_window_s: float = FLOOR_WINDOW_S) -> None:
        self._nc = nc
        self._period_s = period_s
        self._floor = LagFloor(floor_window_s)
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._sent: float | None = None  # when the probe still out was sent
        self._last = 0.0  # the last round trip
        self._due = 0.0  # when the next probe is due to go out (while none is out)
        self._answered = False
        self._back = asyncio.Event()
        # stop() sets it as well as cancelling: before Python 3.12 asyncio.wait_for can swallow a cancellation that
        # lands while its inner wait completes, and the loop then ran on and stop() waited for it forever (the
        # gateway's drain hung in about 1 of 3 test meshes).
        self._stopping = False

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._nc.new_inbox(), cb=self._on_probe)
        self._task = asyncio.ensure_future(self._loop())

    def seconds(self) -> float:
        """The gateway's current input lag (0 until a first probe came back)."""
        if not self._answered or not self._nc.is_connected:
            # Disconnected: no probe can come back, and requests wait for the reconnect (or fail over) on their
            # own; the lag is the last one measured.
            return self._last if self._answered else 0.0
        # The probe out, or the one due next (between probes a stalled event loop delays sending it).
        since = self._sent if self._sent is not None else self._due
        return max(self._last, time.monotonic() - since)

    def limit(self, bound_s: float) -> float:
        """The lag above which admission refuses: `bound_s`, or FLOOR_FACTOR x this machine's recent floor when
        that is higher (the module's docstring)."""
        return max(bound_s, FLOOR_FACTOR * self._floor.seconds(time.monotonic()))

    async def _loop(self) -> None:
        assert self._sub is not None
        while not self._stopping:
            self._back.clear()
            reconnects = self._nc.stats["reconnects"]
            # Timed from when it was due: a loop that stalled before sending it was late by that much too.
            self._sent = min(time.monotonic(), self._due) if self._answered else time.monotonic()
            with contextlib.suppress(Exception):  # reconnecting: the probe waits in the client's buffer
                await self._nc.publish(self._sub.subject, b"")
            while not self._back.is_set() and not self._stopping:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._back.wait(), RECHECK_S)
                if self._nc.stats["reconnects"] != reconnects:  # the probe may have been lost with the connection
                    self._due = time.monotonic()  # the time disconnected is no input lag: measure afresh
                    break
            await asyncio.sleep(self._period_s)

    async def _on_probe(self, _: Msg) -> None:
        if self._sent is not None:
            now = time.monotonic()
            self._last, self._due = now - self._sent, now + self._period_s
            self._floor.note(self._last, now)
            self._sent = None
            self._answered = True
        self._back.set()

    async def stop(self) -> None:
        self._stopping = True
        self._back.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
