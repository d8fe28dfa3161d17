"""Request arrival times: Poisson by default, gamma for burstiness (vLLM's definition)."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n jobs is released.

    Gamma inter-arrivals with shape=burstiness and mean 1/rate: burstiness 1 is Poisson,
    below 1 burstier, above 1 more regular. rate=inf releases everything at once and leaves
    pacing to --max-concurrency.
    """
    if math.isinf(request_rate):
        return [0.0] * n
    assert request_rate > 0 and burstiness > 0
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out immediately
    return np.cumsum(gaps).tolist()
