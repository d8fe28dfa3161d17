"""How kvmesh's load generators come back after a refusal (429, or 503 with Retry-After): when the server says,
plus a little jitter of their own; without a word from it, exponential backoff with full jitter.

The server's advice is read from `retry-after-ms` first (what OpenAI's API and kvmesh's gateway send, exact) and
`Retry-After` (whole seconds) else. The client adds up to JITTER of it on top, so clients refused together by a
server that sends one constant value do not come back together either (kvmesh's own gateway already jitters:
services/gateway/retry_after.py).
"""
from __future__ import annotations

import random
from collections.abc import Mapping

JITTER = 0.25  # the client waits the advice times a uniform draw from [1, 1 + JITTER)
BACKOFF_S = 0.5  # no advice: the first retry's ceiling, doubled per attempt ...
BACKOFF_CAP_S = 30.0  # ... up to this


def advised_s(headers: Mapping[str, str]) -> float | None:
    """The server's Retry-After in seconds (retry-after-ms preferred), or None (absent, an HTTP date, garbage)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue
        if value >= 0:
            return value
    return None


def retry_delay_s(advice_s: float | None, attempt: int, rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (0 for the first) of a refused request."""
    if advice_s is not None:
        return advice_s * (1.0 + JITTER * rng.random())
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_S * 2 ** attempt))
