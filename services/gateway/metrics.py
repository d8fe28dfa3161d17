"""Prometheus metrics of one gateway, in their own registry (no process-global collectors).

Request-level series are measured here, at the edge the client sees; per-worker series (running,
waiting, KV usage) come from the workers' load beats at scrape time.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.router import Router

PREFIX = "kvmesh:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class _WorkerCollector(Collector):
    def __init__(self, router: Router, model: str) -> None:
        self._router = router
        self._model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "worker"]
        running = GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests running on each decode worker", labels=labels)
        waiting = GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting on each decode worker", labels=labels)
        usage = GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "KV-cache usage of each decode worker (0 to 1)", labels=labels)
        alive = GaugeMetricFamily(f"{PREFIX}decode_workers_alive", "Decode workers with a recent load beat", labels=["model_name"])
        workers = self._router.alive()
        for w in workers:
            assert w.beat is not None
            values = [self._model, w.worker_id]
            running.add_metric(values, w.beat.running)
            waiting.add_metric(values, w.beat.waiting)
            usage.add_metric(values, w.kv_usage)
        alive.add_metric([self._model], len(workers))
        yield from (running, waiting, usage, alive)


class GatewayMetrics:
    def __init__(self, router: Router, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.requests = Counter(f"{PREFIX}request_success", "Finished generations by finish reason",
                                m + ["finished_reason"], registry=r)
        self.errors = Counter(f"{PREFIX}request_errors", "Requests answered with an error, by HTTP status",
                              m + ["status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", m, registry=r)
        self.cache_queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix caches",
                                     m, registry=r)
        self.cache_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens served from a prefix cache", m, registry=r)
        self.hit_rate = Gauge(f"{PREFIX}prefix_cache_hit_rate", "Prompt tokens served from a cache / prompt tokens",
                              m, registry=r)
        self.in_flight = Gauge(f"{PREFIX}gateway_requests_in_flight", "HTTP generation requests being served",
                               m, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between streamed token chunks", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival to last token", m,
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_WorkerCollector(router, model))
        self._queries = 0
        self._hits = 0

    def prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.cache_queries.labels(self.model).inc(prompt_tokens)
        self.cache_hits.labels(self.model).inc(cached_tokens)
        self._queries += prompt_tokens
        self._hits += cached_tokens
        self.hit_rate.labels(self.model).set(self._hits / self._queries if self._queries else 0.0)

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
