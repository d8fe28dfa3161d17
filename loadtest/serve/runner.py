"""Glue shared by serve and compare: measure one level, probe EOS under the deadline, plot series."""
from __future__ import annotations

import asyncio
import time
from argparse import Namespace
from dataclasses import replace

from .datasets import Workload
from .eos import EosProbe
from .load import resolve_eos, run_level
from .metrics import summarize
from .options import build_load
from .payload import Endpoint, EosMode
from .plots import Series
from .report import LevelReport
from .spec_metrics import SCRAPE_TIMEOUT_S, SpecCounters, SpecDecodeSummary, scrape

# Exit codes of `bench serve` / `bench compare`, documented in their --help.
EXIT_OK = 0  # the run finished; some requests may have failed (see the report)
EXIT_ALL_FAILED = 1  # not a single request succeeded: server down, wrong model name, ...
EXIT_BAD_ARGS = 2

# The EOS probe is one 2-token request; a server needing longer than this is loading the model,
# and the warm-up requests will wait for it instead.
PROBE_TIMEOUT_S = 60.0


async def prepare(ep: Endpoint, args: Namespace, deadline: float) -> tuple[Endpoint, EosProbe]:
    cfg = build_load(args, None)
    # Bounded on its own: a server that accepts connections but never answers must not eat the
    # whole run's time limit before a single measured request is sent.
    budget = min(PROBE_TIMEOUT_S, args.request_timeout, max(0.1, deadline - time.perf_counter()))
    try:
        return await asyncio.wait_for(resolve_eos(ep, args.eos_mode, cfg), timeout=budget)
    except asyncio.TimeoutError:
        return replace(ep, eos_mode=EosMode.OFF), EosProbe(EosMode.OFF, f"probe got no answer in {budget:g}s; EOS not forced")


async def measure(ep: Endpoint, workload: Workload, args: Namespace, level: int | None, deadline: float,
                  slo: dict[str, float], label: str) -> LevelReport:
    before: list[SpecCounters | None] = [None]

    async def read_before() -> None:
        # A tenth of the time left at most: reading counters must not eat the run's --time-limit (a server
        # that accepts connections and never answers would otherwise take it all before a request is sent).
        before[0] = await _settled_scrape(ep, args, args.num_warmups > 0, 0.1 * (deadline - time.perf_counter()))

    run = await run_level(ep, workload, build_load(args, level), deadline, label, after_warmup=read_before)
    # Only a server that exported the counters before the run is waited for: one without pays nothing.
    after = await _settled_scrape(ep, args, before[0] is not None, deadline - time.perf_counter())
    return LevelReport(run, summarize(run.results, run.duration, run.planned, slo), SpecDecodeSummary.of(before[0], after))


async def _settled_scrape(ep: Endpoint, args: Namespace, requests_just_ran: bool, budget_s: float) -> SpecCounters | None:
    """The server's spec_decode counters, read after --metrics-settle when requests just ran and the server has
    such counters (they may reach its /metrics a load beat late); None past the budget (the time limit)."""
    end = time.perf_counter() + budget_s
    left = lambda: min(SCRAPE_TIMEOUT_S, end - time.perf_counter())  # noqa: E731
    if requests_just_ran and args.metrics_settle > 0 and await scrape(ep.base_url, ep.api_key, left()) is not None:
        await asyncio.sleep(max(0.0, min(args.metrics_settle, end - time.perf_counter())))
    return await scrape(ep.base_url, ep.api_key, left())


def series(label: str, levels: list[LevelReport]) -> Series:
    return Series(
        label=label,
        concurrency=[lv.run.max_concurrency or lv.run.planned for lv in levels],
        summaries=[lv.summary for lv in levels],
        ttft_ms=[[r.ttft * 1000 for r in lv.run.results if r.ok and r.ttft is not None] for lv in levels],
        itl_ms=[[g * 1000 for r in lv.run.results if r.ok for g in r.itl] for lv in levels],
    )


def exit_code(levels: list[LevelReport]) -> int:
    return EXIT_OK if any(lv.summary.completed for lv in levels) else EXIT_ALL_FAILED
