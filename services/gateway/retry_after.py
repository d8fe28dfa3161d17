"""When a refused client should come back: Retry-After from the backlog the gateway measures, with jitter.

A constant Retry-After makes every client refused in the same second come back in the same second: the gateway
admits a few, refuses the rest again, and the load oscillates in lock-step (seen at 2,000 streams on 2 cores). So:

- the estimate is the time the refusal's cause takes to clear: for the input lag (services/gateway/input_lag.py),
  the lag itself (the backlog a lag of L seconds stands for takes about L to drain once new requests stop); for
  the bound on requests at once, the time the requests in flight take to free a slot for each client refused
  lately: refused_recently / finish_rate (requests finished per second, both over the last WINDOW_S);
- the value sent is the estimate times a uniform draw from [1, 2): no client comes back before the estimate, and
  the clients refused together come back spread over the following as-long window.

Sent as `Retry-After` (whole seconds, rounded up: what HTTP allows) and `retry-after-ms` (the exact value: what
OpenAI's API sends and its Python client reads first), so a client that honours either spreads out.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 5.0  # finishes and refusals counted over this long
MIN_S = 0.25  # never sooner: a refused client's round trip is cheap, but not free
MAX_S = 30.0  # never later: the estimate is a rate over a few seconds, not a promise


class RetryAdvice:
    def __init__(self, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._finished: deque[float] = deque()  # when requests finished, the last WINDOW_S
        self._refused: deque[float] = deque()  # when requests were refused, the last WINDOW_S

    def finished(self) -> None:
        """A request the gateway served has ended (any outcome): one slot freed."""
        now = self._clock()
        self._finished.append(now)
        self._trim(now)

    def for_lag(self, lag_s: float) -> float:
        """Seconds to send a client refused because the gateway's input lags `lag_s` behind."""
        now = self._clock()
        self._refused.append(now)
        self._trim(now)
        return self._jittered(lag_s)

    def for_wait(self, excess_s: float) -> float:
        """Seconds to send a client refused because the mesh is expected to start it `excess_s` later than its
        bound on a request's wait (services/gateway/queue_wait.py): the time the queue ahead takes to shrink."""
        now = self._clock()
        self._refused.append(now)
        self._trim(now)
        return self._jittered(excess_s)

    def for_count(self, in_flight: int) -> float:
        """Seconds to send a client refused because `in_flight` requests fill the bound."""
        now = self._clock()
        self._refused.append(now)
        self._trim(now)
        span = min(WINDOW_S, max(now - self._finished[0], 1e-3)) if self._finished else WINDOW_S
        rate = len(self._finished) / span if self._finished else 0.0  # slots freed per second
        if rate <= 0.0:
            # Nothing finished lately: the requests in flight are long ones. Spread the refused over the window.
            return self._jittered(WINDOW_S * len(self._refused) / max(in_flight, 1))
        return self._jittered(len(self._refused) / rate)

    def headers(self, seconds: float) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(round(seconds * 1000))}

    def _jittered(self, estimate_s: float) -> float:
        base = min(max(estimate_s, MIN_S), MAX_S)
        return base * (1.0 + self._rng.random())

    def _trim(self, now: float) -> None:
        for q in (self._finished, self._refused):
            while q and q[0] < now - WINDOW_S:
                q.popleft()
