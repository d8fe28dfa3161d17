"""Cumulative engine counters that a worker reports in its load beats (the vLLM metric set's engine side)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for tokens per engine step.
ITERATION_TOKEN_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class CumulativeHistogram:
    """Prometheus-style: counts[i] observations <= buckets[i] (non-cumulative per bucket, +Inf last)."""

    buckets: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)
