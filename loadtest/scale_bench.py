"""`kvmesh bench scale`: a simulated mesh of 64 decode + 16 prefill workers under streaming
load, on this machine.

One real `kvmesh up --engine sim` (nats-server on its locked-down bus, gateway, tokenizer, the workers packed
--per-process to an OS process: services/sim_pack.py). Measured:
- idle: each process's memory (RSS, PSS) and CPU over --idle-s, per simulated worker;
- per concurrency level (closed loop: N streams each sending its next request when one ends; they start evenly over
  --ramp-s, settle for --settle-s, then --level-s are measured; the load generator is loadtest/lean_http.py, so
  its own CPU is not what saturates):
  requests/s and tokens/s through the gateway, NATS messages/s (nats-server's /varz), CPU per service (cores),
  and what the mesh adds beyond the engine: the client's TTFT against the worker's own queue + first step time,
  and the client's first-to-last token span against the worker's own decode time (both from the gateway's
  worker-timing histograms, which the workers fill from their engine's clock), and the same from the gateway's
  own clock (TTFT and time per output token at the gateway), so the client's lag is not charged to the mesh;
  refusals (429 + Retry-After, retried) counted apart from failures;
- KV-aware routing's prefix hits against round robin on a shared-prefix workload (groups of requests sharing a
  long system prefix), the same requests for both, a fresh mesh each.

Time runs at --speed (the simulated GPU that much slower) so the token rate stays within what the gateway of a
2-core machine carries; which process saturates first is the question the bench answers (`saturated`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.lean_http import LeanConnection
from loadtest.retry import advised_s, retry_delay_s
from loadtest.sim_mesh import SimMesh, cpu_seconds, memory_mib

HIST = re.compile(r'^kvmesh:(request_queue_time_seconds|request_prefill_time_seconds|request_decode_time_seconds|'
                  r'request_generation_tokens|time_to_first_token_seconds|e2e_request_latency_seconds|'
                  r'request_time_per_output_token_seconds)_(sum|count)\{[^}]*\} (\S+)')
GAUGES = re.compile(r'^kvmesh:(gateway_requests_in_flight|gateway_input_lag_seconds)\{[^}]*\} (\S+)')
REFUSED = re.compile(r'^kvmesh:gateway_requests_rejected_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, metavar="PATH")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=16, help="simulated workers per OS process")
    parser.add_argument("--levels", default="100,500,2000@0.001/16/90",
                        help="concurrency levels, comma separated: STREAMS[@SPEED[/OSL[/SECONDS]]] (defaults: --speed, "
                             "--osl, --level-s); a level at another speed gets a fresh mesh (the workers' --sim-speed)")
    parser.add_argument("--level-s", type=float, default=30.0, help="seconds measured per level")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--speed", type=float, default=0.02, help="simulated GPU speed (1: the profile's)")
    parser.add_argument("--isl", type=int, default=200, help="prompt tokens of the streaming levels")
    parser.add_argument("--osl", type=int, default=32, help="output tokens of the streaming levels")
    parser.add_argument("--prefix-groups", type=int, default=32, help="shared-prefix workload: distinct prefixes")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="shared-prefix workload: prefix length")
    parser.add_argument("--prefix-requests", type=int, default=512)
    parser.add_argument("--prefix-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight-requests", type=int, default=None,
                        help="the gateway's bound on requests at once (kvmesh up's flag; default: the largest level's "
                             "streams + 64)")
    parser.add_argument("--skip-prefix", action="store_true", help="leave out the shared-prefix routing runs")
    parser.add_argument("--client", type=_clients, default=["lean"],
                        help="the load generator's HTTP client: lean (loadtest/lean_http.py, ~10x less CPU per token) "
                             "or httpx (the bench's earlier client); a comma list is taken level by level "
                             "in turn (httpx,lean with four equal levels: an interleaved A/B on one mesh)")
    parser.add_argument("--ramp-s", type=float, default=None,
                        help="streams start evenly over this many seconds (default: 5 s per 500 streams, at least 5): "
                             "a closed loop's intake rate is streams / request time, and starting them all at once "
                             "asks the gateway for that many requests in one burst")
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="after the ramp, seconds before the measured window opens (steady state)")


def _clients(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",")]
    if not names or any(n not in ("lean", "httpx") for n in names):
        raise argparse.ArgumentTypeError(f"--client: lean or httpx, comma separated, not {text!r}")
    return names


@dataclass
class Result:
    ttft: float | None = None
    span: float | None = None  # first token -> last token, at the client
    tokens: int = 0
    cached: int = 0
    prompt: int = 0
    error: str | None = None
    retry_after: float | None = None  # the gateway refused at intake (429/503) and said when to come back
    t_first: float | None = None  # monotonic clock: when the first token came (None: none came)
    t_end: float = 0.0  # when the request ended (or was refused, or failed)


@dataclass
class Level:
    streams: int
    results: list[Result] = field(default_factory=list)


def _request_body(prompt: list[int], osl: int) -> dict:
    return {"model": "sim", "prompt": prompt, "max_tokens": osl, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


@dataclass
class _Events:
    """What a streamed completion's SSE events say, the same for both clients."""

    res: Result
    t0: float
    first: float | None = None
    last: float | None = None

    def on(self, msg: dict, now: float) -> bool:
        """Takes one event (arrived at `now`); False: it was an error event and the stream is over."""
        res = self.res
        if "error" in msg:
            res.error = str(msg["error"])[:200]
            return False
        if msg.get("usage"):
            u = msg["usage"]
            res.tokens, res.prompt = u["completion_tokens"], u["prompt_tokens"]
            res.cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if msg.get("choices"):
            self.first = self.first or now
            self.last = now
        return True

    def done(self) -> Result:
        if self.first is not None and self.last is not None:
            self.res.ttft, self.res.span, self.res.t_first = self.first - self.t0, self.last - self.first, self.first
        return self.res


def _refused(res: Result, status: int, text: str, headers) -> Result:  # noqa: ANN001
    res.error = f"HTTP {status}: {text[:160]}"
    if status in (429, 503):
        res.retry_after = advised_s(headers)
    return res


async def _stream_lean(conn: LeanConnection, prompt: list[int], osl: int) -> Result:
    """_stream on the lean client (loadtest/lean_http.py): the same request and the same figures."""
    ev = _Events(Result(), time.monotonic())
    try:
        r = await conn.post_json("/v1/completions", _request_body(prompt, osl))
        if r.status != 200:
            return _refused(ev.res, r.status, (await r.read()).decode(errors="replace"), r.headers)
        async for batch in r.sse_data():
            now = time.monotonic()  # one socket read: every event in it arrived now
            for data in batch:
                if data != "[DONE]" and not ev.on(json.loads(data), now):
                    conn.close()
                    return ev.res
    except Exception as e:  # noqa: BLE001 - a failed request is counted, never fatal
        conn.close()
        ev.res.error = f"{type(e).__name__}: {e}"[:200]
        return ev.res
    return ev.done()


async def _stream(client, base: str, prompt: list[int], osl: int) -> Result:  # noqa: ANN001
    ev = _Events(Result(), time.monotonic())
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=_request_body(prompt, osl)) as r:
            if r.status_code != 200:
                return _refused(ev.res, r.status_code, (await r.aread()).decode(errors="replace"), r.headers)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not ev.on(json.loads(line[6:]), time.monotonic()):
                    return ev.res
    except Exception as e:  # noqa: BLE001 - a failed request is counted, never fatal
        ev.res.error = f"{type(e).__name__}: {e}"[:200]
        return ev.res
    return ev.done()


def _machine_busy_s() -> float:
    """CPU-seconds every core of the machine spent busy (all processes, other people's work included)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _histograms(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := HIST.search(line):
            out[f"{m[1]}_{m[2]}"] = out.get(f"{m[1]}_{m[2]}", 0.0) + float(m[3])
    return out


def _cpu_by_service(mesh: SimMesh, client_pid: int) -> dict[str, float]:
    cpu = mesh.cpu()
    cpu["client"] = cpu_seconds(client_pid)
    out: dict[str, float] = {}
    for name, s in cpu.items():
        key = re.sub(r"-(pack-)?\d+$", "", name)  # decode-pack-3 -> decode, gateway-0 -> gateway
        out[key] = out.get(key, 0.0) + s
    return out


def _gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := GAUGES.search(line):
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
        elif m := REFUSED.search(line):
            out[f"refused_{m[1]}"] = out.get(f"refused_{m[1]}", 0.0) + float(m[2])
    return out


def ramp_seconds(streams: int, ramp_s: float | None) -> float:
    """Default ramp: 5 s per 500 streams (at least 5 s), so the intake rate while streams start stays near the
    closed loop's steady rate (streams / request time: ~10 s a request at the bench's default speed and length)."""
    return ramp_s if ramp_s is not None else max(5.0, 5.0 * streams / 500)


async def run_level(mesh: SimMesh, level: Level, isl: int, osl: int, seconds: float, seed: int, vocab: int,
                    client: str = "lean", ramp_s: float | None = None, settle_s: float = 5.0) -> dict:
    import httpx

    rng = random.Random(seed)
    ramp = ramp_seconds(level.streams, ramp_s)
    limits = httpx.Limits(max_connections=level.streams + 16, max_keepalive_connections=level.streams + 16)
    every: list[Result] = []  # each request's outcome, when it ended: the window is chosen from them afterwards
    samples: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        closing = asyncio.Event()

        async def stream_loop() -> None:
            failures = 0
            conn = LeanConnection(mesh.base) if client == "lean" else None
            try:
                while not closing.is_set():
                    prompt = [rng.randrange(10, vocab - 10) for _ in range(isl)]
                    r = await (_stream_lean(conn, prompt, osl) if conn is not None else
                               _stream(http, mesh.base, prompt, osl))
                    r.t_end = time.monotonic()
                    every.append(r)
                    if r.error:
                        # Back off as a client would: as long as the gateway's Retry-After says, with jitter
                        # (loadtest/retry.py), else exponential backoff.
                        await asyncio.sleep(retry_delay_s(r.retry_after, failures, rng))
                        failures += 1
                    else:
                        failures = 0
            finally:
                if conn is not None:
                    conn.close()

        # Ramp over `ramp` s of wall time, as many at a time as the clock says (one stream per short sleep took
        # minutes at 2,000 streams once the client's own loop was busy with the first ones: each sleep lasts a
        # turn), then settle, then measure: the window sees the closed loop's steady state, not the start-up storm.
        tasks: list[asyncio.Task] = []
        t_ramp = time.monotonic()
        while len(tasks) < level.streams:
            due = min(level.streams, int(level.streams * (time.monotonic() - t_ramp) / ramp) + 1)
            tasks += [asyncio.create_task(stream_loop()) for _ in range(due - len(tasks))]
            await asyncio.sleep(0.01)
        ramp_took = time.monotonic() - t_ramp
        await asyncio.sleep(settle_s)
        text0 = (await http.get(f"{mesh.base}/metrics")).text
        metrics0, gauges0 = _histograms(text0), _gauges(text0)
        varz0, cpu0, t_open = mesh.varz(), _cpu_by_service(mesh, os.getpid()), time.monotonic()
        busy0 = _machine_busy_s()
        # Sample the gateway's in-flight count and input lag through the window (a few /metrics reads, 10 s apart).
        while (left := t_open + seconds - time.monotonic()) > 0:
            await asyncio.sleep(min(10.0, left))  # a /metrics render costs the gateway ~0.1 s of CPU
            if t_open + seconds - time.monotonic() > 1.0:
                samples.append(_gauges((await http.get(f"{mesh.base}/metrics")).text))
        closing.set()
        t_close = time.monotonic()
        varz1, cpu1, busy1 = mesh.varz(), _cpu_by_service(mesh, os.getpid()), _machine_busy_s()
        text1 = (await http.get(f"{mesh.base}/metrics")).text
        metrics1, gauges1 = _histograms(text1), _gauges(text1)
        window = t_close - t_open
        await asyncio.wait(tasks, timeout=120)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Throughput and the client's figures against the worker's: the requests that ended in the window (the
    # workers' histograms are filled as requests end). The client's TTFT against the gateway's: the requests
    # whose first token came in the window (the gateway fills its TTFT histogram at the first token).
    level.results = [r for r in every if t_open <= r.t_end <= t_close]
    before = [r for r in every if r.t_end < t_open]  # during the ramp and settling
    first_in_window = [r.ttft for r in every if r.t_first is not None and t_open <= r.t_first <= t_close]
    ok = [r for r in level.results if not r.error and r.ttft is not None]
    d = {k: metrics1.get(k, 0.0) - metrics0.get(k, 0.0) for k in metrics1}
    n_worker = d.get("request_decode_time_seconds_count", 0.0)
    worker_ttft = ((d.get("request_queue_time_seconds_sum", 0) + d.get("request_prefill_time_seconds_sum", 0)) / n_worker
                   if n_worker else None)
    worker_span = d.get("request_decode_time_seconds_sum", 0) / n_worker if n_worker else None
    n_gw = d.get("time_to_first_token_seconds_count", 0.0)
    gateway_ttft = d.get("time_to_first_token_seconds_sum", 0.0) / n_gw if n_gw else None
    n_tpot = d.get("request_time_per_output_token_seconds_count", 0.0)
    gateway_tpot = d.get("request_time_per_output_token_seconds_sum", 0.0) / n_tpot if n_tpot else None
    # The gateway's TTFT over the requests that ended in the window, as the worker's figures are: its arrival ->
    # last chunk less its first -> last chunk (e2e - tpot x (tokens - 1), exact when every request has as many
    # tokens). Its TTFT histogram is filled at the first token instead: another set of requests, and while the
    # queues still grow or shrink a different mean.
    n_e2e, n_gen = d.get("e2e_request_latency_seconds_count", 0.0), d.get("request_generation_tokens_count", 0.0)
    gateway_ttft_ended = (d.get("e2e_request_latency_seconds_sum", 0.0) / n_e2e - gateway_tpot *
                          (d.get("request_generation_tokens_sum", 0.0) / n_gen - 1)
                          if n_e2e and n_gen and gateway_tpot is not None else None)
    client_ttft = sum(r.ttft for r in ok) / len(ok) if ok else None
    client_span = sum(r.span for r in ok) / len(ok) if ok else None
    tokens = sum(r.tokens for r in ok)
    cores = {k: (cpu1[k] - cpu0.get(k, 0.0)) / window for k in cpu1}
    per_token = (client_span - worker_span) / max(1, osl - 1) if client_span is not None and worker_span else None
    # The worker's decode time per token after the first, over the tokens its requests generated (a request that
    # ended early on EOS has fewer than osl): what the gateway's request_time_per_output_token averages too.
    gaps = d.get("request_generation_tokens_sum", 0.0) - d.get("request_generation_tokens_count", 0.0)
    worker_tpot = (d.get("request_decode_time_seconds_sum", 0.0) / gaps if gaps > 0 else
                   worker_span / max(1, osl - 1) if worker_span is not None else None)

    def frac(a: float | None, b: float | None) -> float | None:
        return a / b - 1 if a is not None and b else None

    refused = [r for r in level.results if r.error and r.retry_after is not None]
    return {
        "streams": level.streams, "client": client, "ramp_s": ramp_took, "settle_s": settle_s, "window_s": window,
        "finished": len(ok), "errors": len(level.results) - len(ok),
        # Of the errors: refused at intake with Retry-After (the gateway's admission bound), nothing started.
        "refused": len(refused),
        "refused_by_reason_at_gateway": {k[8:]: gauges1.get(k, 0.0) - gauges0.get(k, 0.0)
                                         for k in gauges1 if k.startswith("refused_")},
        "failed_after_admission": sum(1 for r in level.results if r.error and r.retry_after is None),
        # Before the window (ramp and settling): how many the start-up refused, not counted above.
        "before_window": {"finished": sum(1 for r in before if not r.error),
                          "refused": sum(1 for r in before if r.error and r.retry_after is not None),
                          "failed": sum(1 for r in before if r.error and r.retry_after is None)},
        "gateway_in_flight": [s.get("gateway_requests_in_flight") for s in samples],
        "gateway_input_lag_s": [round(s.get("gateway_input_lag_seconds", 0.0), 3) for s in samples],
        "error_examples": sorted({r.error for r in level.results if r.error})[:3],
        "requests_per_s": len(ok) / window, "output_tokens_per_s": tokens / window,
        "nats_msgs_per_s": {"in": (varz1.get("in_msgs", 0) - varz0.get("in_msgs", 0)) / window,
                            "out": (varz1.get("out_msgs", 0) - varz0.get("out_msgs", 0)) / window},
        "nats_bytes_per_s": {"in": (varz1.get("in_bytes", 0) - varz0.get("in_bytes", 0)) / window,
                             "out": (varz1.get("out_bytes", 0) - varz0.get("out_bytes", 0)) / window},
        "cpu_cores_by_service": {k: round(v, 3) for k, v in sorted(cores.items())},
        # The load generator's CPU per token it received: what the client costs, apart from the mesh.
        "client_cpu_ms_per_token": 1000 * cores.get("client", 0.0) * window / tokens if tokens else None,
        "gateway_cpu_ms_per_token": 1000 * cores.get("gateway", 0.0) * window / tokens if tokens else None,
        # The whole machine's busy cores in the window: the mesh and the client, plus everyone else's work.
        "machine_busy_cores": (busy1 - busy0) / window, "machine_cores": os.cpu_count(),
        # gateway_mean: HTTP arrival at the gateway -> first chunk out of it (what the client adds is the rest).
        # mesh_added_*: the client's figure against the worker's own clock (the load generator's lag included);
        # gateway_added_*: the gateway's own figure against the worker's (what the mesh adds, no client in it).
        "ttft_s": {"client_mean": client_ttft, "gateway_mean": gateway_ttft_ended, "worker_mean": worker_ttft,
                   # The same requests at the client and the gateway: those whose first token came in the window.
                   "gateway_mean_first_token_in_window": gateway_ttft,
                   "client_mean_first_token_in_window": sum(first_in_window) / len(first_in_window)
                   if first_in_window else None,
                   "mesh_added_s": client_ttft - worker_ttft if client_ttft and worker_ttft else None,
                   "mesh_added_fraction": frac(client_ttft, worker_ttft),
                   "gateway_added_s": gateway_ttft_ended - worker_ttft
                   if gateway_ttft_ended is not None and worker_ttft else None,
                   "gateway_added_fraction": frac(gateway_ttft_ended, worker_ttft)},
        "per_output_token_s": {"client_mean": client_span / max(1, osl - 1) if client_span is not None else None,
                               "gateway_mean": gateway_tpot, "worker_mean": worker_tpot,
                               "mesh_added_s": per_token,
                               "mesh_added_fraction": frac(client_span, worker_span),
                               "gateway_added_s": gateway_tpot - worker_tpot
                               if gateway_tpot is not None and worker_tpot is not None else None,
                               "gateway_added_fraction": frac(gateway_tpot, worker_tpot)},
    }


async def prefix_run(mesh: SimMesh, reqs: list[list[int]], concurrency: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def one(prompt: list[int]) -> None:
            async with sem:
                results.append(await _stream(client, mesh.base, prompt, 4))

        t0 = time.monotonic()
        await asyncio.gather(*(one(p) for p in reqs))
        wall = time.monotonic() - t0
    ok = [r for r in results if not r.error]
    prompt = sum(r.prompt for r in ok)
    return {"requests": len(reqs), "finished": len(ok), "errors": len(results) - len(ok),
            "prefix_hit_rate": sum(r.cached for r in ok) / prompt if prompt else None,
            "cached_tokens": sum(r.cached for r in ok), "prompt_tokens": prompt, "wall_s": wall,
            "ttft_mean_s": sum(r.ttft for r in ok if r.ttft) / len(ok) if ok else None}


def _idle(mesh: SimMesh, seconds: float, per_process: int) -> dict:
    pids = mesh.service_pids()
    c0 = {n: cpu_seconds(p) for n, p in pids.items()}
    time.sleep(seconds)
    c1 = {n: cpu_seconds(p) for n, p in pids.items()}
    procs = {n: {**memory_mib(p), "idle_cpu_cores": (c1[n] - c0[n]) / seconds} for n, p in pids.items()}
    packs = [v for n, v in procs.items() if "pack" in n]
    workers = mesh.decode + mesh.prefill
    return {"processes": procs, "worker_processes": len(packs),
            "per_worker": {"pss_mib": sum(v["pss_mib"] for v in packs) / workers,
                           "rss_mib": sum(v["rss_mib"] for v in packs) / workers,
                           "idle_cpu_cores": sum(v["idle_cpu_cores"] for v in packs) / workers},
            "workers_per_process": per_process}


def _level_spec(text: str, args: argparse.Namespace) -> tuple[int, float, int, float]:
    """STREAMS[@SPEED[/OSL[/SECONDS]]] -> (streams, speed, osl, seconds)."""
    streams, _, rest = text.strip().partition("@")
    parts = rest.split("/") if rest else []
    return (int(streams), float(parts[0]) if parts else args.speed, int(parts[1]) if len(parts) > 1 else args.osl,
            float(parts[2]) if len(parts) > 2 else args.level_s)


def _saturated(levels: list[dict]) -> list[dict]:
    """Per level: the busiest service (cores) and the machine's busy cores, beside the mesh's added time."""
    out = []
    for lv in levels:
        cores = lv["cpu_cores_by_service"]
        name = max(cores, key=cores.get)
        out.append({"streams": lv["streams"], "busiest": name, "cores": cores[name],
                    "mesh_and_client_cores": sum(cores.values()), "machine_busy_cores": lv["machine_busy_cores"],
                    "per_token_added_fraction": lv["per_output_token_s"]["mesh_added_fraction"],
                    "per_token_added_fraction_at_gateway": lv["per_output_token_s"]["gateway_added_fraction"],
                    "ttft_added_fraction_at_gateway": lv["ttft_s"]["gateway_added_fraction"],
                    "errors": lv["errors"], "refused": lv["refused"]})
    return out


def run(args: argparse.Namespace) -> int:
    from loadtest.sim_model import build_sim_model

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvmesh-scale-bench-"))
    model = build_sim_model(work / "model")
    vocab = min(json.loads((model / "config.json").read_text())["vocab_size"], 2000)
    specs = [_level_spec(x, args) for x in args.levels.split(",")]
    # The gateway's bound on requests at once (default 1,024) would refuse half of 2,000 streams before its input
    # lag had a say: by default the bench lets in every stream of its largest level.
    inflight = args.max_inflight_requests if args.max_inflight_requests is not None else \
        max(n for n, _, _, _ in specs) + 64
    gateway = ["--max-inflight-requests", str(inflight)]
    common = ["--sim-speed", f"{args.speed:g}", *gateway]
    out: dict = {"config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list))}}
    out["config"]["max_inflight_requests"] = inflight
    levels: list[dict] = []
    out["stopped_cleanly"] = True
    for speed in dict.fromkeys(sp for _, sp, _, _ in specs):  # one mesh per speed, in the order given
        t_up = time.monotonic()
        with SimMesh(model, args.decode, args.prefill, args.per_process, ["--sim-speed", f"{speed:g}", *gateway],
                     work / f"mesh-{speed:g}.log") as mesh:
            if "idle" not in out:
                out["startup_s"] = time.monotonic() - t_up
                out["idle"] = _idle(mesh, args.idle_s, args.per_process)
                print(f"[bench scale] up in {out['startup_s']:.0f}s; idle per worker "
                      f"{json.dumps(out['idle']['per_worker'])}", flush=True)
            for i, (n, sp, osl, seconds) in enumerate(specs):
                if sp != speed:
                    continue
                lv = asyncio.run(run_level(mesh, Level(n), args.isl, osl, seconds, args.seed + i, vocab,
                                           args.client[i % len(args.client)], args.ramp_s, args.settle_s))
                lv["sim_speed"] = speed
                levels.append(lv)
                print(f"[bench scale] {n} streams at speed {speed:g}: {json.dumps(lv)}", flush=True)
            out["stopped_cleanly"] &= mesh.stop() == 0
    out["levels"] = levels
    out["saturated"] = _saturated(levels)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, vocab - 10) for _ in range(args.prefix_tokens)] for _ in range(args.prefix_groups)]
    reqs = [prefixes[rng.randrange(args.prefix_groups)] + [rng.randrange(10, vocab - 10) for _ in range(64)]
            for _ in range(args.prefix_requests)]
    out["prefix_routing"] = {}
    for routing in () if args.skip_prefix else ("kv", "round-robin"):
        with SimMesh(model, args.decode, args.prefill, args.per_process, [*common, "--routing", routing],
                     work / f"mesh-{routing}.log") as mesh:
            out["prefix_routing"][routing] = asyncio.run(prefix_run(mesh, reqs, args.prefix_concurrency))
        print(f"[bench scale] shared prefixes, {routing}: {json.dumps(out['prefix_routing'][routing])}", flush=True)
    out["machine"] = {"cpu_count": os.cpu_count(), "loadavg_1m_5m_15m": list(os.getloadavg()),
                      "note": "2-core machine shared with other work: figures are noisy"}
    out["bench_wall_s"] = time.monotonic() - t_start
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"saturated": out["saturated"],
                      "prefix_hit_rate": {k: v["prefix_hit_rate"] for k, v in out["prefix_routing"].items()}}))
    return 0
