"""Driving a workload at a server: arrivals, max concurrency, warm-up and a hard deadline."""
from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import httpx
from tqdm import tqdm

from loadtest.lean_http import LeanClient

from .arrivals import arrival_offsets
from loadtest.retry import retry_delay_s

from .client import RequestResult, send
from .datasets import Job, Workload
from .eos import EosProbe, probe_eos_mode
from .payload import Endpoint, EosMode, Message


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    request_timeout: float = 300.0
    progress: bool = True
    # A refused request (429, or 503 with Retry-After) is sent again up to this many times, after the server's
    # Retry-After with jitter (loadtest/retry.py); 0: a refusal is a failed request.
    retries: int = 0
    # "lean" (loadtest/lean_http.py) for plain http:// targets; "httpx" (the default) for everything.
    http_client: str = "httpx"


@dataclass
class LevelRun:
    """One pass of the workload at one concurrency level."""

    max_concurrency: int | None
    request_rate: float
    planned: int
    duration: float
    results: list[RequestResult]
    hit_time_limit: bool


def _client(cfg: LoadConfig, ep: Endpoint) -> httpx.AsyncClient:
    if cfg.http_client == "lean" and ep.url.startswith("http://"):
        # loadtest/lean_http.py: ~10x less of the load generator's CPU per streamed token than httpx, for runs of
        # thousands of streams where the client would otherwise be the busiest process on the machine.
        return LeanClient(cfg.request_timeout)  # type: ignore[return-value]
    # trust_env=False: a benchmark must not silently go through a proxy from the environment.
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 1000, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(10.0, cfg.request_timeout))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def resolve_eos(ep: Endpoint, requested: str, cfg: LoadConfig) -> tuple[Endpoint, EosProbe]:
    """requested is "auto" or an EosMode value; auto asks the server what it accepts."""
    if requested != "auto":
        return replace(ep, eos_mode=EosMode(requested)), EosProbe(EosMode(requested), "set by --eos-mode")
    async with _client(replace(cfg, http_client="httpx"), ep) as client:  # one probe: httpx's full API
        probe = await probe_eos_mode(client, ep)
    return replace(ep, eos_mode=probe.mode), probe


async def _run_job(
    client: httpx.AsyncClient, ep: Endpoint, job: Job, delay: float, origin: float,
    sem: asyncio.Semaphore, sink: list[RequestResult], bar: tqdm | None,
    retries: int = 0, rng: random.Random | None = None,
) -> None:
    """One conversation, turn after turn. A refused turn is sent again up to `retries` times (LoadConfig.retries);
    only its last attempt is a result, which counts the refusals before it and the time waited."""
    rng = rng or random.Random(job.index)
    await asyncio.sleep(delay)
    history: list[Message] = []
    for t, turn in enumerate(job.turns):
        async with sem:
            r = RequestResult(job.index, t, turn.output_len, turn.prompt_len)
            try:
                await send(client, ep, turn.prompt, history, r, origin)
                waited = 0.0
                for attempt in range(retries):
                    if r.ok or not _refused(r):
                        break
                    wait = retry_delay_s(r.retry_after_s, attempt, rng)
                    await asyncio.sleep(wait)
                    waited += wait
                    r = RequestResult(job.index, t, turn.output_len, turn.prompt_len, retries=attempt + 1,
                                      retry_wait_s=waited)
                    await send(client, ep, turn.prompt, history, r, origin)
            finally:
                # Appended even when cancelled, so sent == succeeded + failed always holds.
                sink.append(r)
                if bar is not None:
                    bar.update(1)
        if not r.ok:
            return  # a conversation cannot continue past a failed turn
        history += [Message("user", str(turn.prompt)), Message("assistant", r.text)]


def _refused(r: RequestResult) -> bool:
    """The server turned the request away before doing anything (nothing to lose by sending it again)."""
    return r.status == 429 or (r.status == 503 and r.retry_after_s is not None)


async def _warm_up(client: httpx.AsyncClient, ep: Endpoint, workload: Workload, cfg: LoadConfig, deadline: float) -> None:
    """Unmeasured requests first: servers compile, allocate caches and load lazily on the first ones."""
    if cfg.num_warmups <= 0:
        return
    jobs = [workload.jobs[i % len(workload.jobs)] for i in range(cfg.num_warmups)]
    sem = asyncio.Semaphore(cfg.max_concurrency or len(jobs))
    sink: list[RequestResult] = []
    origin = time.perf_counter()
    tasks = [asyncio.ensure_future(_run_job(client, ep, Job(-1, j.turns[:1]), 0.0, origin, sem, sink, None)) for j in jobs]
    await _wait_or_cancel(tasks, deadline)


async def _wait_or_cancel(tasks: list[asyncio.Future], deadline: float) -> bool:
    """Wait for tasks until the deadline; cancel the rest. True when the deadline cut them off."""
    if not tasks:
        return False
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return bool(pending)


async def run_level(ep: Endpoint, workload: Workload, cfg: LoadConfig, deadline: float, label: str = "",
                    after_warmup: Callable[[], Awaitable[None]] | None = None) -> LevelRun:
    """Send the whole workload once. Stops at `deadline` (a time.perf_counter() value) no matter what.
    after_warmup: awaited between the warm-up and the measured requests (server counters read before the run)."""
    async with _client(cfg, ep) as client:
        await _warm_up(client, ep, workload, cfg, deadline)
        if after_warmup is not None:
            await after_warmup()
        offsets = arrival_offsets(len(workload.jobs), cfg.request_rate, cfg.burstiness, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency or max(1, workload.num_requests))
        sink: list[RequestResult] = []
        bar = tqdm(total=workload.num_requests, desc=label or None, file=sys.stderr, disable=not cfg.progress, leave=False)
        origin = time.perf_counter()
        rng = random.Random(cfg.seed)  # one for every job: their retry delays differ
        tasks = [
            asyncio.ensure_future(_run_job(client, ep, job, off, origin, sem, sink, bar, cfg.retries, rng))
            for job, off in zip(workload.jobs, offsets)
        ]
        cut = await _wait_or_cancel(tasks, deadline)
        duration = time.perf_counter() - origin
        bar.close()
    sink.sort(key=lambda r: (r.start, r.job, r.turn))
    return LevelRun(cfg.max_concurrency, cfg.request_rate, workload.num_requests, duration, sink, cut)
