"""How long a new request would wait before the mesh starts it, and the bound on that wait (--max-queue-wait).

Without a bound, a mesh sent more than it computes queues the excess in the decode workers' engines: on a 2-core
CPU, 32 concurrent chat streams left most requests without a first token after a minute while the engines worked
through a backlog whose clients had mostly given up. A request the mesh cannot start in time is better refused
at once (a 429 with Retry-After, which OpenAI's client honours) than answered after its client left. So, per
served model:

- the queue: requests the gateway has sent to the workers that have not had their first token yet (queued in an
  engine, or prefilling);
- the start rate: first tokens per second over the last WINDOW_S (what the mesh actually starts, whatever its
  hardware, model or prompt lengths);
- a new request's expected wait is queue / rate. Past the bound it gets a 429 whose Retry-After is the time the
  excess takes to start (services/gateway/retry_after.py adds the jitter). With no start in the window at all,
  the wait is at least the age of the oldest request still waiting: past the bound, refused too.

And a request already sent that gets no first token within the bound is given up: its workers are told to drop it
(so no KV stays held for a client that is gone) and it is answered 503 with Retry-After (generation.py).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 20.0  # first tokens counted over this long
MIN_STARTS = 3  # fewer starts in the window are no rate to extrapolate from (only the oldest waiter's age counts)


class QueueWait:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._starts: deque[float] = deque()  # when requests got their first token, the last WINDOW_S
        self._waiting: dict[int, float] = {}  # a waiting request's token -> when it was sent
        self._next = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def enter(self) -> int:
        """A request was sent to the workers and waits for its first token; the token to pass to leave()."""
        self._next += 1
        self._waiting[self._next] = self._clock()
        return self._next

    def leave(self, token: int, started: bool) -> None:
        """The request stopped waiting: it started (its first token came) or it failed or was given up."""
        if self._waiting.pop(token, None) is not None and started:
            now = self._clock()
            self._starts.append(now)
            self._trim(now)

    def start_rate(self) -> float | None:
        """Requests started per second over the window; None with too few starts to tell."""
        now = self._clock()
        self._trim(now)
        if len(self._starts) < MIN_STARTS:
            return None
        # Intervals between starts over the time they span up to now: a mesh that stopped starting slows down.
        return (len(self._starts) - 1) / max(now - self._starts[0], 1e-3)

    def expected_wait_s(self) -> float:
        """How long a request sent now would wait for its first token, from the queue ahead of it."""
        if not self._waiting:
            return 0.0
        now = self._clock()
        oldest = now - min(self._waiting.values())
        rate = self.start_rate()
        if rate is None:
            return oldest  # nothing measurable starts: at least as long as the oldest has waited already
        return max((len(self._waiting) + 1) / rate, 0.0)

    def _trim(self, now: float) -> None:
        while self._starts and self._starts[0] < now - WINDOW_S:
            self._starts.popleft()
