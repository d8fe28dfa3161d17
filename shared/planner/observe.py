"""What the planner sees each interval: the mesh's own metrics, read from the gateway's /metrics.

A Snapshot is the cumulative state at one moment (per-role worker gauges from the workers' load beats, the
gateway's request counters and TTFT/ITL histograms); an Observation is the difference of two snapshots,
so rates, means and quantiles describe the last interval only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

P = "kvmesh:"
# The gateway's histograms the planner reads. Prompt and output lengths come from the per-request histograms,
# observed when a request finishes, so a window's mean length and its finished count describe the same requests
# (the token counters move at admission and per token, and would not).
HISTOGRAMS = {P + "time_to_first_token_seconds": "ttft", P + "inter_token_latency_seconds": "itl",
              P + "request_prompt_tokens": "isl", P + "request_generation_tokens": "osl"}


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (upper bounds ascending, +Inf last), their sum and count."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()
    total: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        if earlier.bounds != self.bounds or earlier.count > self.count:  # a restarted gateway: start over
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                         self.total - earlier.total, self.count - earlier.count)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Linear within the bucket, as Prometheus' histogram_quantile."""
        if not self.count:
            return None
        rank = q * self.count
        lo, below = 0.0, 0.0
        for le, c in zip(self.bounds, self.counts):
            if c >= rank:
                if math.isinf(le):
                    return lo
                return lo + (le - lo) * ((rank - below) / (c - below) if c > below else 1.0)
            lo, below = le, c
        return lo

    def share_within(self, limit: float) -> float | None:
        """Fraction of observations at or under `limit` (interpolated within its bucket)."""
        if not self.count:
            return None
        lo, below = 0.0, 0.0
        for le, c in zip(self.bounds, self.counts):
            if limit <= le:
                if math.isinf(le):
                    return below / self.count
                frac = (limit - lo) / (le - lo) if le > lo else 1.0
                return (below + frac * (c - below)) / self.count
            lo, below = le, c
        return 1.0


@dataclass(frozen=True)
class Snapshot:
    at: float
    workers: dict[str, int] = field(default_factory=dict)  # role -> workers beating
    running: dict[str, float] = field(default_factory=dict)  # role -> requests running, summed
    waiting: dict[str, float] = field(default_factory=dict)
    kv_usage: dict[str, float] = field(default_factory=dict)  # role -> mean KV usage (0..1)
    finished: float = 0.0  # choices finished (cumulative)
    errors: float = 0.0
    in_flight: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    migrations: float = 0.0
    ttft: Histogram = Histogram()
    itl: Histogram = Histogram()
    isl: Histogram = Histogram()
    osl: Histogram = Histogram()


@dataclass(frozen=True)
class Observation:
    """One interval."""

    window_s: float
    workers: dict[str, int]
    running: dict[str, float]
    waiting: dict[str, float]
    kv_usage: dict[str, float]
    finished: float
    arrived: float  # finished + the change in requests in flight
    errors: float
    prompt_tokens: float
    generation_tokens: float
    ttft: Histogram
    itl: Histogram
    isl: Histogram = Histogram()
    osl: Histogram = Histogram()

    @property
    def arrival_rate(self) -> float:
        return max(0.0, self.arrived) / self.window_s if self.window_s > 0 else 0.0

    @property
    def mean_isl(self) -> float | None:
        return self.isl.mean

    @property
    def mean_osl(self) -> float | None:
        return self.osl.mean


def observe(now: Snapshot, before: Snapshot | None) -> Observation:
    b = before or Snapshot(at=now.at)
    return Observation(
        window_s=now.at - b.at if before else 0.0, workers=dict(now.workers), running=dict(now.running),
        waiting=dict(now.waiting), kv_usage=dict(now.kv_usage), finished=now.finished - b.finished,
        arrived=(now.finished - b.finished) + (now.in_flight - b.in_flight) + (now.errors - b.errors),
        errors=now.errors - b.errors, prompt_tokens=now.prompt_tokens - b.prompt_tokens,
        generation_tokens=now.generation_tokens - b.generation_tokens,
        ttft=now.ttft.minus(b.ttft), itl=now.itl.minus(b.itl), isl=now.isl.minus(b.isl), osl=now.osl.minus(b.osl))


def parse_metrics(text: str, at: float | None = None, model: str | None = None) -> Snapshot:
    """A Snapshot from the gateway's Prometheus text (model: only that served model's series, for a mesh of
    several models, each planned apart)."""
    workers: dict[str, int] = {}
    running: dict[str, float] = {}
    waiting: dict[str, float] = {}
    usage: dict[str, list[float]] = {}
    scalars = {"finished": 0.0, "errors": 0.0, "in_flight": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0,
               "migrations": 0.0}
    hists: dict[str, Histogram] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if model is not None:
            fam.samples = [s for s in fam.samples if s.labels.get("model_name", model) == model]
        if name == P + "workers_alive":
            for s in fam.samples:
                workers[s.labels.get("role", "")] = int(s.value)
        elif name in (P + "num_requests_running", P + "num_requests_waiting"):
            into = running if name.endswith("running") else waiting
            for s in fam.samples:
                role = s.labels.get("role", "")
                into[role] = into.get(role, 0.0) + s.value
        elif name == P + "kv_cache_usage_perc":
            for s in fam.samples:
                usage.setdefault(s.labels.get("role", ""), []).append(s.value)
        elif name in (P + "request_success", P + "request_errors", P + "prompt_tokens", P + "generation_tokens",
                      P + "request_migrations"):
            key = {"request_success": "finished", "request_errors": "errors",
                   "request_migrations": "migrations"}.get(name[len(P):], name[len(P):])
            scalars[key] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif name == P + "gateway_requests_in_flight":
            scalars["in_flight"] = sum(s.value for s in fam.samples)
        elif name in HISTOGRAMS:
            buckets: dict[float, float] = {}
            total = count = 0.0
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
            bounds = tuple(sorted(buckets))
            hists[HISTOGRAMS[name]] = Histogram(
                bounds, tuple(buckets[b] for b in bounds), total, count)
    return Snapshot(at=time.monotonic() if at is None else at, workers=workers, running=running, waiting=waiting,
                    kv_usage={r: sum(v) / len(v) for r, v in usage.items() if v},
                    **{k: hists.get(k, Histogram()) for k in ("ttft", "itl", "isl", "osl")}, **scalars)


class GatewayMetrics:
    """Reads a gateway's /metrics over HTTP."""

    def __init__(self, url: str, timeout_s: float = 5.0, model: str | None = None) -> None:
        import httpx

        self.url = url
        self.model = model  # None: every model's series together (a one-model mesh)
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def __call__(self) -> Snapshot:
        r = await self._client.get(self.url)
        r.raise_for_status()
        return parse_metrics(r.text, model=self.model)

    async def close(self) -> None:
        await self._client.aclose()
