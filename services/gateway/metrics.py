"""Prometheus metrics of one gateway, in their own registry (no process-global collectors).

The vLLM metric set under the `kvmesh:` prefix. Request-level series are measured here, at the edge the
client sees, plus the queue/prefill/decode split each worker reports with a request's last chunk.
Per-worker series (running, waiting, KV usage, preemptions, prefix-cache queries and hits, tokens per
engine step, cache config, offload, KV pushes and handout, speculative decoding) come from the workers' load
beats, labelled with `worker` and `role`; workers send a beat as soon as those change, so the gauges trail the
engine by tens of milliseconds. Every series carries `model_name` (vLLM's label): a gateway serving several
models has one GatewayMetrics per model (`for_model`), all in one registry.
"""
from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.gateway.router import Router
from shared.protocol.events import LoadBeat
from shared.protocol.generate import RequestTimings
from shared.protocol.kvstore import StatsReply

PREFIX = "kvmesh:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05) + _E2E_BUCKETS
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class PrefillWorkers:
    """Latest beat of each prefill worker (the router tracks decode workers; prefill ones are only shown)."""

    def __init__(self, expiry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.expiry_s = expiry_s
        self._clock = clock
        self._beats: dict[str, tuple[LoadBeat, float]] = {}

    def on_beat(self, beat: LoadBeat) -> None:
        self._beats[beat.worker_id] = (beat, self._clock())

    def alive(self) -> list[LoadBeat]:
        now = self._clock()
        for wid in [w for w, (_, seen) in self._beats.items() if now - seen > self.expiry_s]:
            del self._beats[wid]
        return [b for b, _ in sorted(self._beats.values(), key=lambda x: x[0].worker_id)]


class KVStoreFigures(Collector):
    """The kvstore's tiers, from the stats it announces every 2 s (gone after three missed announcements)."""

    def __init__(self, model: str, expiry_s: float = 6.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._model, self._expiry_s, self._clock = model, expiry_s, clock
        self._last: tuple[StatsReply, float] | None = None

    def on_stats(self, stats: StatsReply) -> None:
        self._last = (stats, self._clock())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model_name", "tier"]
        blocks = GaugeMetricFamily(f"{PREFIX}kvstore_blocks", "KV blocks the kvstore holds, per tier", labels=labels)
        nbytes = GaugeMetricFamily(f"{PREFIX}kvstore_bytes", "Bytes of KV the kvstore holds, per tier", labels=labels)
        hits = CounterMetricFamily(f"{PREFIX}kvstore_hit_blocks", "Blocks the kvstore served, per tier",
                                   labels=labels)
        misses = CounterMetricFamily(f"{PREFIX}kvstore_miss_blocks", "Blocks asked of the kvstore that it lacked",
                                     labels=["model_name"])
        if self._last is not None and self._clock() - self._last[1] <= self._expiry_s:
            s = self._last[0]
            for tier, b, n, h in (("cpu", s.cpu_blocks, s.cpu_bytes, s.cpu_hits),
                                  ("disk", s.disk_blocks, s.disk_bytes, s.disk_hits)):
                blocks.add_metric([self._model, tier], b)
                nbytes.add_metric([self._model, tier], n)
                hits.add_metric([self._model, tier], h)
            misses.add_metric([self._model], s.misses)
        yield from (blocks, nbytes, hits, misses)


class _WorkerCollector(Collector):
    """Every served model's workers (one collector: the series' names are registered once)."""

    def __init__(self, router: Router, prefill: PrefillWorkers, model: str) -> None:
        self._models = [(model, router, prefill)]

    def add(self, router: Router, prefill: PrefillWorkers, model: str) -> None:
        self._models.append((model, router, prefill))

    def snapshot(self) -> list[tuple[str, list[LoadBeat], list[LoadBeat]]]:
        """Each model's live decode and prefill beats, as they are now: taken on the event loop (the router's
        state is the loop's), rendered anywhere (beats are frozen)."""
        return [(model, [w.beat for w in router.alive() if w.beat is not None], prefill.alive())
                for model, router, prefill in self._models]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        return worker_families(self.snapshot())


def worker_families(models: list[tuple[str, list[LoadBeat], list[LoadBeat]]]
                    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    """The per-worker series of a snapshot (_WorkerCollector.snapshot)."""
    labels = ["model_name", "worker", "role"]
    running = GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the worker's running batch", labels=labels)
    waiting = GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting in the worker", labels=labels)
    usage = GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "KV-cache usage of the worker (0 to 1)", labels=labels)
    preempt = CounterMetricFamily(f"{PREFIX}num_preemptions", "Preemptions in the worker's engine", labels=labels)
    queries = CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                  "caches (the worker's own, then the kvstore)", labels=labels)
    hits = CounterMetricFamily(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in a prefix cache", labels=labels)
    iteration = HistogramMetricFamily(f"{PREFIX}iteration_tokens_total", "Tokens computed per engine step",
                                      labels=labels)
    config = GaugeMetricFamily(f"{PREFIX}cache_config_info", "KV-cache configuration of the worker",
                               labels=labels + ["block_size", "num_gpu_blocks", "cache_dtype"])
    offloaded = CounterMetricFamily(f"{PREFIX}kv_offloaded_blocks", "KV blocks the worker handed to the kvstore",
                                    labels=labels)
    dropped = CounterMetricFamily(f"{PREFIX}kv_offload_dropped_blocks", "KV blocks not offloaded under "
                                  "backpressure (requests are never dropped)", labels=labels)
    tier_hits = CounterMetricFamily(f"{PREFIX}kv_tier_hit_tokens", "Prompt tokens loaded from a tier below "
                                    "the device pool: the worker's host tier or the kvstore",
                                    labels=labels + ["tier"])
    host_bytes = GaugeMetricFamily(f"{PREFIX}host_tier_bytes", "Bytes of KV in the worker's host tier",
                                   labels=labels)
    pushes = CounterMetricFamily(f"{PREFIX}kv_pushes", "KV transfers a prefill worker pushed to decode workers",
                                 labels=labels)
    push_bytes = CounterMetricFamily(f"{PREFIX}kv_push_bytes", "Bytes of KV a prefill worker pushed",
                                     labels=labels)
    push_wait = CounterMetricFamily(f"{PREFIX}kv_push_wait_seconds", "Seconds decode workers waited for pushed "
                                    "KV after the prompt's last chunk computed (what compute did not hide)",
                                    labels=labels)
    replays = CounterMetricFamily(f"{PREFIX}stream_replays", "Token chunks a gateway lost over a NATS reconnect "
                                  "that the decode worker resent from its recent chunks (no migration)",
                                  labels=labels)
    replay_misses = CounterMetricFamily(f"{PREFIX}stream_replay_misses", "Replays the decode worker could not "
                                        "serve (chunks no longer kept, unknown request): the choice migrated",
                                        labels=labels)
    handout = CounterMetricFamily(f"{PREFIX}kv_handout_seconds", "Engine seconds a prefill worker spent handing "
                                  "pushed KV out (reading the captured blocks, or rank-to-rank shard sends): "
                                  "the part of a push inside its engine steps", labels=labels)
    # vLLM's spec_decode counters (vllm:spec_decode_num_drafts, ...) under the kvmesh prefix.
    drafts = CounterMetricFamily(f"{PREFIX}spec_decode_num_drafts", "Verify steps of a request with drafted "
                                 "tokens (speculative decoding)", labels=labels)
    draft_tokens = CounterMetricFamily(f"{PREFIX}spec_decode_num_draft_tokens", "Tokens drafted for verification",
                                       labels=labels)
    accepted = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens", "Drafted tokens the target accepted",
                                   labels=labels)
    per_pos = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at this "
                                  "position was accepted", labels=labels + ["position"])
    verify_steps = CounterMetricFamily(f"{PREFIX}spec_decode_verify_steps", "Engine steps that verified drafts, "
                                       "by how they ran: graph (a captured CUDA graph replayed), padded_eager "
                                       "(the graphs' padded path, capture off), eager (the runner's eager path)",
                                       labels=labels + ["path"])
    alive = GaugeMetricFamily(f"{PREFIX}workers_alive", "Workers with a recent load beat",
                              labels=["model_name", "role"])
    for model, decode, prefill in models:
        alive.add_metric([model, "decode"], len(decode))
        alive.add_metric([model, "prefill"], len(prefill))
        for b in decode + prefill:
            v = [model, b.worker_id, b.role]
            running.add_metric(v, b.running)
            waiting.add_metric(v, b.waiting)
            usage.add_metric(v, 1.0 - b.free_blocks / b.total_blocks if b.total_blocks else 0.0)
            preempt.add_metric(v, b.num_preemptions)
            queries.add_metric(v, b.prefix_cache_queries)
            hits.add_metric(v, b.prefix_cache_hits)
            offloaded.add_metric(v, b.offloaded_blocks)
            dropped.add_metric(v, b.offload_dropped_blocks)
            tier_hits.add_metric(v + ["host"], b.host_tier_hit_tokens)
            tier_hits.add_metric(v + ["kvstore"], b.kvstore_hit_tokens)
            host_bytes.add_metric(v, b.host_tier_bytes)
            pushes.add_metric(v, b.kv_pushes)
            push_bytes.add_metric(v, b.kv_push_bytes)
            push_wait.add_metric(v, b.kv_push_wait_seconds)
            if b.role == "decode":
                replays.add_metric(v, b.stream_replays)
                replay_misses.add_metric(v, b.stream_replay_misses)
            handout.add_metric(v, b.kv_handout_seconds)
            if b.iteration_token_buckets and len(b.iteration_token_counts) == len(b.iteration_token_buckets) + 1:
                cumulative, acc = [], 0
                for le, n in zip([str(x) for x in b.iteration_token_buckets] + ["+Inf"], b.iteration_token_counts):
                    acc += n
                    cumulative.append((le, acc))
                iteration.add_metric(v, cumulative, b.iteration_tokens_sum)
            if b.spec_num_drafts:
                drafts.add_metric(v, b.spec_num_drafts)
                draft_tokens.add_metric(v, b.spec_num_draft_tokens)
                accepted.add_metric(v, b.spec_num_accepted_tokens)
                for pos, n in enumerate(b.spec_num_accepted_tokens_per_pos):
                    per_pos.add_metric(v + [str(pos)], n)
            if b.spec_verify_graph_replays or b.spec_verify_padded_eager or b.spec_verify_eager:
                for path, n in (("graph", b.spec_verify_graph_replays), ("padded_eager", b.spec_verify_padded_eager),
                                ("eager", b.spec_verify_eager)):
                    verify_steps.add_metric(v + [path], n)
            config.add_metric(v + [str(b.block_size), str(b.total_blocks), b.kv_cache_dtype or "auto"], 1.0)
    yield from (running, waiting, usage, preempt, queries, hits, offloaded, dropped, tier_hits, host_bytes,
                pushes, push_bytes, push_wait, handout, replays, replay_misses, iteration, config, drafts,
                draft_tokens, accepted, per_pos, verify_steps, alive)


class GatewayMetrics:
    def __init__(self, router: Router, model: str, prefill: PrefillWorkers | None = None) -> None:
        self.model = model
        self.prefill_workers = prefill or PrefillWorkers(router.config.expiry_s)
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.requests = Counter(f"{PREFIX}request_success", "Finished generations by finish reason",
                                m + ["finished_reason"], registry=r)
        self.errors = Counter(f"{PREFIX}request_errors", "Requests answered with an error, by HTTP status",
                              m + ["status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", m, registry=r)
        self.migrations = Counter(f"{PREFIX}request_migrations", "Choices moved to another decode worker after "
                                  "theirs stopped answering", m, registry=r)
        self.hit_rate = Gauge(f"{PREFIX}prefix_cache_hit_rate", "Prompt tokens served from a cache / prompt tokens, "
                              "over the requests this gateway served", m, registry=r)
        self.in_flight = Gauge(f"{PREFIX}gateway_requests_in_flight", "HTTP generation requests being served",
                               m, registry=r)
        self.rejected = Counter(f"{PREFIX}gateway_requests_rejected", "Requests refused at intake before any work, "
                                "by reason (max_inflight_requests: the gateway's bound on requests at once)",
                                m + ["reason"], registry=r)
        self.max_inflight = Gauge(f"{PREFIX}gateway_max_inflight_requests", "The gateway's bound on generation "
                                  "requests served at once (0: none)", m, registry=r)
        self.input_lag = Gauge(f"{PREFIX}gateway_input_lag_seconds", "Round trip of a probe the gateway sends "
                               "itself over NATS: how far behind its input it is", m, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between streamed token chunks", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival to last token", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds", "Time a request waited in its worker "
                                    "before its first step", m, buckets=_PHASE_BUCKETS, registry=r)
        self.prefill_time = Histogram(f"{PREFIX}request_prefill_time_seconds", "First step to first token", m,
                                      buckets=_PHASE_BUCKETS, registry=r)
        self.decode_time = Histogram(f"{PREFIX}request_decode_time_seconds", "First token to last token", m,
                                     buckets=_PHASE_BUCKETS, registry=r)
        self.inference_time = Histogram(f"{PREFIX}request_inference_time_seconds", "First step to last token", m,
                                        buckets=_PHASE_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(f"{PREFIX}request_prompt_tokens", "Prompt tokens per request", m,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(f"{PREFIX}request_generation_tokens", "Generated tokens per "
                                                   "request (choice)", m, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_max_tokens = Histogram(f"{PREFIX}request_params_max_tokens", "max_tokens asked per request", m,
                                            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_n = Histogram(f"{PREFIX}request_params_n", "n (choices) asked per request", m,
                                   buckets=(1, 2, 5, 10, 20), registry=r)
        self.request_max_generation = Histogram(f"{PREFIX}request_max_num_generation_tokens", "Generated tokens of "
                                                "the request's longest choice", m, buckets=_TOKEN_BUCKETS, registry=r)
        # vLLM's older name for the inter-token latency (the same observations), kept as vLLM still exports it.
        self.tpot = Histogram(f"{PREFIX}time_per_output_token_seconds", "Time between streamed token chunks "
                              "(vLLM's older name of inter_token_latency_seconds)", m, buckets=_ITL_BUCKETS, registry=r)
        self.request_tpot = Histogram(f"{PREFIX}request_time_per_output_token_seconds", "A choice's decode time "
                                      "per output token after the first", m, buckets=_ITL_BUCKETS, registry=r)
        # Not in the registry: a scrape renders the workers' series from a snapshot taken on the event loop.
        self._workers = _WorkerCollector(router, self.prefill_workers, model)
        self._scrape = _Scrape()  # shared by every model's view (copy.copy)
        self.kvstore = KVStoreFigures(model)
        r.register(self.kvstore)
        self._queries = 0
        self._hits = 0
        # The per-token series, their one label resolved once (a labels() lookup per token per series showed in
        # the gateway's profile).
        self._per_token = (self.itl.labels(model), self.tpot.labels(model))
        self.model_generation_tokens = self.generation_tokens.labels(model)

    def for_model(self, model: str, router: Router) -> GatewayMetrics:
        """The same registry's series for another model the gateway serves, with its own decode workers (router)
        and prefill workers."""
        view = copy.copy(self)
        view.model = model
        view.prefill_workers = PrefillWorkers(router.config.expiry_s)
        view._queries = view._hits = 0
        view._per_token = (self.itl.labels(model), self.tpot.labels(model))
        view.model_generation_tokens = self.generation_tokens.labels(model)
        self._workers.add(router, view.prefill_workers, model)
        return view

    def prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._queries += prompt_tokens
        self._hits += cached_tokens
        self.hit_rate.labels(self.model).set(self._hits / self._queries if self._queries else 0.0)

    def choice_done(self, prompt_tokens: int, generated_tokens: int, max_tokens: int,
                    timings: RequestTimings | None) -> None:
        """One choice finished normally: its token counts and, when its worker measured them, its phases."""
        self.request_prompt_tokens.labels(self.model).observe(prompt_tokens)
        self.request_generation_tokens.labels(self.model).observe(generated_tokens)
        self.request_max_tokens.labels(self.model).observe(max_tokens)
        if timings is not None:
            self.queue_time.labels(self.model).observe(timings.queued_s)
            self.prefill_time.labels(self.model).observe(timings.prefill_s)
            self.decode_time.labels(self.model).observe(timings.decode_s)
            self.inference_time.labels(self.model).observe(timings.prefill_s + timings.decode_s)

    def inter_token(self, seconds: float) -> None:
        for series in self._per_token:
            series.observe(seconds)

    def request_done(self, generated: list[list[int]], ttft_s: float | None, e2e_s: float) -> None:
        """A request whose every choice finished, as generated tokens per choice of each prompt (a batch of
        prompts counts as that many requests, as in vLLM): n, the longest choice, time per output token."""
        for choices in generated:
            self.request_n.labels(self.model).observe(len(choices))
            self.request_max_generation.labels(self.model).observe(max(choices, default=0))
            for tokens in choices:
                if ttft_s is not None and tokens > 1:
                    self.request_tpot.labels(self.model).observe(max(0.0, e2e_s - ttft_s) / (tokens - 1))

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return self._render(self._workers.snapshot())

    def _render(self, workers: list[tuple[str, list[LoadBeat], list[LoadBeat]]]) -> bytes:
        return generate_latest(self.registry) + generate_latest(_Families(workers))

    async def scrape(self) -> bytes:
        """/metrics without holding the event loop: the workers' beats are snapshotted on the loop and rendered
        in a thread (thousands of series from many workers' beats take a while); scrapes that arrive while one
        renders share its text, so a burst of scrapes costs one render. A finished render is never reused: a
        scrape after a request ended must count it."""
        s = self._scrape
        if s.rendering is None:
            s.rendering = asyncio.ensure_future(asyncio.to_thread(self._render, self._workers.snapshot()))
            s.rendering.add_done_callback(s.done)
        return await asyncio.shield(s.rendering)


class _Scrape:
    """The render in progress, shared by every model's view."""

    def __init__(self) -> None:
        self.rendering: asyncio.Future[bytes] | None = None

    def done(self, _: asyncio.Future[bytes]) -> None:
        self.rendering = None


class _Families:
    """A registry-like view of a snapshot's worker series, for generate_latest."""

    def __init__(self, workers: list[tuple[str, list[LoadBeat], list[LoadBeat]]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        return worker_families(self._workers)
