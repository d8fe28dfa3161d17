"""What the gateway itself sees of a decode worker, whatever its load beats claim: the token streams it sent
there that are not over yet (flights), and how fast the worker answers them, smoothed (time from dispatch to the
first token, and the gap per token after it), as measured at the gateway, link delay included.

A beat is the worker's word; these are the gateway's own observations, so a worker cannot talk them down: the
router (services/gateway/router.py) takes a beat's counts only where they are higher than these, and weighs a
worker's observed slowness into its load. The flights of one worker are bounded by the gateway's own
requests in flight; they are dropped with the worker when the router forgets it (it died).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ewma:
    """An exponentially weighted moving average; None until the first sample."""
    alpha: float
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class Flight:
    """One token stream the gateway sent to the worker."""
    sent: float  # local monotonic time of the dispatch
    prompt_tokens: int
    tokens: int = 0  # tokens arrived so far
    last: float | None = None  # arrival of the latest chunk; None: no token yet (queued or prefilling)


@dataclass
class ObservedLoad:
    ttft: Ewma = field(default_factory=lambda: Ewma(0.2))  # seconds from dispatch to the first chunk
    gap: Ewma = field(default_factory=lambda: Ewma(0.1))  # seconds between chunks, per token
    flights: dict[str, Flight] = field(default_factory=dict)  # by the stream's request id
    last_sample: float = float("-inf")  # when either average last moved
    routed: int = 0  # streams dispatched here (cumulative, for /get_load)
    running: int = 0  # flights with a token already (the rest wait: queued or prefilling there)

    def dispatched(self, key: str, prompt_tokens: int, now: float) -> None:
        self.flights[key] = Flight(now, prompt_tokens)
        self.routed += 1

    def arrived(self, key: str, tokens: int, now: float) -> None:
        f = self.flights.get(key)
        if f is None:
            return
        if f.last is None:
            self.ttft.add(now - f.sent)
            self.running += 1
        elif tokens > 0:
            self.gap.add((now - f.last) / tokens)
        self.last_sample = now
        f.tokens += tokens
        f.last = now

    def landed(self, key: str) -> Flight | None:
        """The stream is over on this worker (finished, refused, aborted, moved elsewhere)."""
        f = self.flights.pop(key, None)
        if f is not None and f.last is not None:
            self.running -= 1
        return f

    @property
    def waiting(self) -> int:
        """Streams with no token yet: queued or prefilling there."""
        return len(self.flights) - self.running

    def sent_before(self, t: float) -> int:
        """Flights dispatched at or before t (the worker must know of them by a beat produced after t)."""
        return sum(1 for f in self.flights.values() if f.sent <= t)

    def blocks(self, block_size: int) -> int:
        """KV blocks the flights' sequences span (shared prefixes counted once per flight: an upper estimate)."""
        return sum(-(-(f.prompt_tokens + f.tokens) // block_size) for f in self.flights.values())
