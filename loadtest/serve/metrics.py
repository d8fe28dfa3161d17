"""Summary figures as vLLM's `bench serve` defines them.

- request throughput = completed requests / benchmark duration
- output (input) token throughput = output (input) tokens of completed requests / duration
- TTFT: request start -> first chunk carrying text
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token
- ITL: every gap between consecutive text-carrying chunks, pooled over all requests
  (a chunk carrying several tokens gives one gap, as in vLLM)
- E2E: request start -> last byte
- goodput: completed requests meeting every given SLO / duration
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from .client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Dist:
    """A latency distribution in milliseconds."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None
    min: float | None
    max: float | None
    count: int

    @staticmethod
    def of(seconds: list[float]) -> "Dist":
        if not seconds:
            return Dist(None, None, None, None, None, None, None, 0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return Dist(float(ms.mean()), float(p50), float(p90), float(p99), float(ms.std()), float(ms.min()), float(ms.max()), len(ms))


@dataclass(frozen=True)
class Summary:
    duration_s: float
    planned: int
    sent: int
    completed: int
    failed: int
    not_sent: int
    total_input_tokens: int
    total_output_tokens: int
    requested_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    slo_ms: dict[str, float]
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2el_ms: Dist
    short_outputs: int  # completed with fewer tokens than requested: EOS (or a cap) not overridden
    output_tokens_source: dict[str, int]
    errors: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def tpot(r: RequestResult) -> float | None:
    if not r.ok or r.output_tokens <= 1 or r.e2e is None or r.ttft is None:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slo[key] = float(value)
    return slo


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.e2e}
    for key, limit_ms in slo.items():
        v = values[key]
        if v is None:
            if key == "tpot":
                continue  # a single output token has no TPOT, so it cannot miss a TPOT SLO
            return False
        if v * 1000.0 > limit_ms:
            return False
    return True


def summarize(results: list[RequestResult], duration: float, planned: int, slo: dict[str, float] | None = None) -> Summary:
    slo = slo or {}
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    dur = max(duration, 1e-9)
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if _meets(r, slo)) / dur if slo else None
    errors = Counter((r.error or "unknown")[:200] for r in bad)
    return Summary(
        duration_s=duration,
        planned=planned,
        sent=len(results),
        completed=len(ok),
        failed=len(bad),
        not_sent=planned - len(results),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        requested_output_tokens=sum(r.requested_output_tokens for r in ok),
        request_throughput=len(ok) / dur,
        input_throughput=n_in / dur,
        output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur,
        goodput=good,
        slo_ms=dict(slo),
        ttft_ms=Dist.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Dist.of([t for r in ok if (t := tpot(r)) is not None]),
        itl_ms=Dist.of([g for r in ok for g in r.itl]),
        e2el_ms=Dist.of([r.e2e for r in ok if r.e2e is not None]),
        short_outputs=sum(1 for r in ok if r.output_tokens < r.requested_output_tokens),
        output_tokens_source=dict(Counter(r.output_tokens_source for r in ok)),
        errors=dict(errors.most_common()),
    )
