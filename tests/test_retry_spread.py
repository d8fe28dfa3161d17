"""kvmesh's load generators after a refusal (loadtest/retry.py): they honour the server's Retry-After (the exact
retry-after-ms first) plus jitter of their own, so clients refused together come back spread out, even from a
server that tells them all the same value."""
from __future__ import annotations

import random

from loadtest.retry import BACKOFF_CAP_S, JITTER, advised_s, retry_delay_s


def test_advice_is_read_from_retry_after_ms_first() -> None:
    assert advised_s({"retry-after-ms": "1234", "retry-after": "2"}) == 1.234
    assert advised_s({"retry-after": "3"}) == 3.0
    assert advised_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None  # a date: not ours to parse
    assert advised_s({"retry-after-ms": "soon", "retry-after": "2"}) == 2.0
    assert advised_s({}) is None and advised_s({"retry-after": "-1"}) is None


def test_clients_told_the_same_wait_come_back_spread_out() -> None:
    rng = random.Random(1)
    waits = sorted(retry_delay_s(2.0, 0, rng) for _ in range(200))  # 200 clients, one constant Retry-After
    assert 2.0 <= waits[0] and waits[-1] < 2.0 * (1 + JITTER)  # never before the advice, not much after
    assert len(set(waits)) == 200
    # Spread over the jitter window: each tenth of it gets some of them, none gets most.
    buckets = [0] * 10
    for w in waits:
        buckets[min(9, int((w - 2.0) / (2.0 * JITTER) * 10))] += 1
    assert min(buckets) > 0 and max(buckets) < 50


def test_no_advice_backs_off_exponentially_with_full_jitter() -> None:
    rng = random.Random(2)
    for attempt in range(8):
        waits = [retry_delay_s(None, attempt, rng) for _ in range(100)]
        ceiling = min(BACKOFF_CAP_S, 0.5 * 2 ** attempt)
        assert all(0 <= w <= ceiling for w in waits) and max(waits) > 0.5 * ceiling
