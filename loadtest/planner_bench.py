"""`kvmesh bench planner`: the planner against fixed prefill:decode splits on a shifting workload, with
simulated engine workers (`kvmesh up --engine sim`) and a fixed budget of workers.

The workload has a prefill-heavy phase (prompts of ~4k tokens, 64 out) then a decode-heavy one (256 in,
~1k out), Poisson arrivals, the same requests (seeded) for every layout. Each layout is a real `kvmesh up`
(nats-server, gateway, tokenizer, one process per simulated worker, the supervisor, and for the planner
its loop scaling workers through the supervisor, draining the ones it removes). Requests stream through
the gateway; a request meets the SLOs when its TTFT and its mean inter-token gap are both within them.
goodput = such requests per second of workload. Lost = requests that failed or came back short.

Time is dilated by --speed (the simulated GPU runs that much slower, and the SLOs and rates stretch with it)
so the token rate through the gateway stays within what a 2-core machine carries; recorded in the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.engine.sim_profile import DEFAULT_PROFILE, load_profile

CUT = "unfinished at the bench's cutoff"
READY = re.compile(r"kvmesh is up at (http://\S+)/v1")
PLANNER_URL = re.compile(r"decisions at (http://\S+)/decisions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, metavar="PATH")
    parser.add_argument("--png", default="loadtest/results/planner_sim.png", metavar="PATH",
                        help="workers per role and SLO attainment over time (needs matplotlib)")
    parser.add_argument("--budget", type=int, default=4, help="engine workers in every layout")
    parser.add_argument("--splits", default=None,
                        help="fixed prefill:decode splits to compare, e.g. 1:3,2:2,3:1 (default: every split)")
    parser.add_argument("--speed", type=float, default=0.15, help="simulated GPU speed (SLOs stretch by 1/speed)")
    parser.add_argument("--kv-tokens", type=int, default=0, help="KV capacity of each simulated worker (0: the profile's)")
    parser.add_argument("--phase-a-s", type=float, default=50.0, help="seconds of the prefill-heavy phase")
    parser.add_argument("--phase-b-s", type=float, default=110.0, help="seconds of the decode-heavy phase")
    parser.add_argument("--rate-a", type=float, default=2.1, help="requests/s (wall) in the prefill-heavy phase")
    parser.add_argument("--rate-b", type=float, default=2.7, help="requests/s (wall) in the decode-heavy phase")
    parser.add_argument("--ttft-slo-ms", type=float, default=600.0, help="TTFT target at speed 1")
    parser.add_argument("--itl-slo-ms", type=float, default=12.0, help="inter-token target at speed 1")
    parser.add_argument("--interval", type=float, default=4.0, help="planner interval (s)")
    parser.add_argument("--cutoff-s", type=float, default=60.0,
                        help="seconds after the last arrival the bench waits; requests still running then miss the SLO")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))


@dataclass
class Phase:
    name: str
    seconds: float
    rate: float
    isl: int
    osl: int


@dataclass
class Record:
    phase: str
    sent: float  # seconds since the workload started
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    want: int = 0
    done: float | None = None
    error: str | None = None


@dataclass
class Layout:
    name: str
    prefill: int
    decode: int
    planner: bool = False
    records: list[Record] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests_for(phases: list[Phase], seed: int, vocab: int) -> list[tuple[float, Phase, list[int]]]:
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for ph in phases:
        t = t0
        while True:
            t += rng.expovariate(ph.rate)
            if t >= t0 + ph.seconds:
                break
            isl = max(16, int(rng.gauss(ph.isl, ph.isl * 0.1)))
            out.append((t, Phase(ph.name, ph.seconds, ph.rate, isl, max(8, int(rng.gauss(ph.osl, ph.osl * 0.1)))),
                        [rng.randrange(10, vocab - 10) for _ in range(isl)]))
        t0 += ph.seconds
    return out


async def one_request(client, base: str, rec: Record, prompt: list[int], osl: int) -> None:  # noqa: ANN001
    body = {"model": "sim", "prompt": prompt, "max_tokens": osl, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = last = None
    n = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line[:40]:
                    rec.error = line[:200]
                    return
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                n += 1
    except Exception as e:  # noqa: BLE001 - every failure is a lost request, counted, never fatal
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.tokens = n
    rec.done = time.monotonic()
    if first is not None:
        rec.ttft = first - t0
        rec.itl = (last - first) / (n - 1) if n > 1 else 0.0


async def run_workload(base: str, planner_url: str | None, layout: Layout,
                       reqs: list[tuple[float, Phase, list[int]]], cutoff_s: float) -> None:
    import httpx

    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.monotonic()
        tasks = []

        async def sample() -> None:
            while True:
                counts = {"prefill": layout.prefill, "decode": layout.decode}
                if planner_url:
                    try:
                        got = (await client.get(f"{planner_url}/decisions", timeout=5)).json()
                        counts = got["counts"]
                        layout.decisions = got["decisions"]
                    except Exception:  # noqa: BLE001 - a missed sample is a gap in the plot, nothing more
                        pass
                layout.timeline.append({"t": time.monotonic() - start, **counts})
                await asyncio.sleep(2.0)

        sampler = asyncio.create_task(sample())
        for at, ph, prompt in reqs:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = Record(ph.name, at, want=ph.osl)
            layout.records.append(rec)
            tasks.append(asyncio.create_task(one_request(client, base, rec, prompt, ph.osl)))
        # Past the cutoff the rest cannot meet a TTFT SLO any more: stopped and counted apart (not "lost": the
        # bench cut them, the mesh did not drop them).
        _, pending = await asyncio.wait(tasks, timeout=cutoff_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for rec in layout.records:
            if rec.done is None and rec.error is None:
                rec.error = CUT
        sampler.cancel()
        layout.wall_s = time.monotonic() - start


def run_layout(layout: Layout, args: argparse.Namespace, model: Path, profile: Path,
               reqs: list[tuple[float, Phase, list[int]]]) -> None:
    port = _free_port()
    argv = [sys.executable, "-m", "shared.cli", "up", "--engine", "sim", "--model", str(model), "--served-model-name",
            "sim", "--sim-profile", str(profile), "--sim-speed", f"{args.speed:g}", "--kvstore", "0", "--port",
            str(port), "--prefill", str(layout.prefill), "--decode", str(layout.decode), "--log-level", "warning"]
    if layout.planner:
        b = args.budget
        # The SLOs in wall time: the workers (and the planner's profile) run at --speed.
        argv += ["--planner", "sla", "--ttft-slo-ms", f"{args.ttft_slo_ms / args.speed:g}",
                 "--itl-slo-ms", f"{args.itl_slo_ms / args.speed:g}",
                 "--planner-profile", str(profile), "--prefill-min", "0", "--prefill-max", str(b - 1),
                 "--decode-min", "1", "--decode-max", str(b), "--planner-budget", str(b),
                 "--planner-interval", f"{args.interval:g}", "--planner-port", str(_free_port())]
    log = open(Path(args.json).with_suffix(f".{layout.name}.log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = planner_url = None
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if m := PLANNER_URL.search(line):
            planner_url = m.group(1)
        if m := READY.search(line):
            base = m.group(1)
        if base and (planner_url or not layout.planner):
            break
        if time.monotonic() > deadline:
            break
    if base is None:
        proc.kill()
        raise RuntimeError(f"{layout.name}: the mesh did not come up (see {log.name})")
    import threading

    def drain_output() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)

    reader = threading.Thread(target=drain_output, daemon=True)
    reader.start()
    try:
        asyncio.run(run_workload(base, planner_url, layout, reqs, args.cutoff_s))
    finally:
        # Time scaled by the speed, the SLOs stretch alike; the SIGINT drains the mesh like a Ctrl-C.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
        log.close()


def summarize(layout: Layout, ttft_slo: float, itl_slo: float, duration: float) -> dict:
    recs = layout.records
    cut = [r for r in recs if r.error == CUT]
    lost = [r for r in recs if r.error != CUT and (r.error or r.tokens < r.want)]
    met = [r for r in recs if not r.error and r.tokens >= r.want and r.ttft is not None and r.ttft <= ttft_slo
           and (r.itl or 0.0) <= itl_slo]
    by_phase = {}
    for ph in sorted({r.phase for r in recs}):
        rs = [r for r in recs if r.phase == ph]
        ok = [r for r in met if r.phase == ph]
        ttfts = sorted(r.ttft for r in rs if r.ttft is not None)
        itls = sorted(r.itl for r in rs if r.itl is not None)
        pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
        by_phase[ph] = {"requests": len(rs), "met_slo": len(ok), "attainment": len(ok) / len(rs) if rs else None,
                        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9),
                        "itl_p50_s": pct(itls, 0.5), "itl_p90_s": pct(itls, 0.9)}
    return {"prefill": layout.prefill, "decode": layout.decode, "planner": layout.planner, "requests": len(recs),
            "met_slo": len(met), "goodput_rps": len(met) / duration, "lost": len(lost), "cut_at_cutoff": len(cut),
            "lost_examples": [r.error or f"{r.tokens}/{r.want} tokens" for r in lost[:5]],
            "attainment": len(met) / len(recs) if recs else None, "phases": by_phase, "wall_s": layout.wall_s}


def run(args: argparse.Namespace) -> int:
    from loadtest.sim_model import build_sim_model

    t_start = time.monotonic()
    b = args.budget
    splits = ([tuple(int(x) for x in s.split(":")) for s in args.splits.split(",")] if args.splits
              else [(p, b - p) for p in range(1, b)])
    if (b // 2, b - b // 2) not in splits:
        splits.append((b // 2, b - b // 2))
    work = Path(tempfile.mkdtemp(prefix="kvmesh-planner-bench-"))
    model = build_sim_model(work / "model")
    base_profile = load_profile(args.profile)
    profile = work / "profile.json"
    kv = args.kv_tokens or base_profile.kv_tokens
    profile.write_text(json.dumps(base_profile.model_copy(update={
        "name": base_profile.name + (f"-kv{kv}" if args.kv_tokens else ""), "kv_tokens": kv}).model_dump()))
    phases = [Phase("prefill-heavy", args.phase_a_s, args.rate_a, 4096, 64),
              Phase("decode-heavy", args.phase_b_s, args.rate_b, 256, 1024)]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = requests_for(phases, args.seed, min(vocab, 2000))
    duration = args.phase_a_s + args.phase_b_s
    ttft_slo, itl_slo = args.ttft_slo_ms / 1000 / args.speed, args.itl_slo_ms / 1000 / args.speed
    layouts = [Layout(f"fixed-{p}p{d}d", p, d) for p, d in splits]
    layouts.append(Layout("planner", b // 2, b - b // 2, planner=True))
    results = {}
    for lay in layouts:
        print(f"[bench planner] {lay.name}: {len(reqs)} requests over {duration:g}s", flush=True)
        run_layout(lay, args, model, profile, reqs)
        results[lay.name] = summarize(lay, ttft_slo, itl_slo, duration)
        print(f"[bench planner] {lay.name}: {json.dumps(results[lay.name])}", flush=True)
    fixed = {k: v for k, v in results.items() if not v["planner"]}
    one_to_one = results[f"fixed-{b // 2}p{b - b // 2}d"]
    best_name = max(fixed, key=lambda k: fixed[k]["goodput_rps"])
    pl = results["planner"]
    out = {
        "goodput_ratio_vs_1to1": pl["goodput_rps"] / one_to_one["goodput_rps"] if one_to_one["goodput_rps"] else None,
        "goodput_ratio_vs_best_fixed": pl["goodput_rps"] / fixed[best_name]["goodput_rps"]
        if fixed[best_name]["goodput_rps"] else None,
        "lost": pl["lost"], "lost_all_layouts": sum(v["lost"] for v in results.values()),
        "best_fixed": best_name, "layouts": results,
        "planner_decisions": layouts[-1].decisions,
        "timeline": {lay.name: lay.timeline for lay in layouts},
        "workload": {"phases": [asdict(p) for p in phases], "requests": len(reqs), "seed": args.seed,
                     "budget": b, "speed": args.speed, "kv_tokens_per_worker": kv,
                     "ttft_slo_ms_at_speed_1": args.ttft_slo_ms, "itl_slo_ms_at_speed_1": args.itl_slo_ms,
                     "ttft_slo_s_wall": ttft_slo, "itl_slo_s_wall": itl_slo, "profile": base_profile.name,
                     "planner_interval_s": args.interval},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_1m_5m_15m": list(os.getloadavg()),
                    "note": "2-core machine shared with other work: figures are noisy"},
        "bench_wall_s": time.monotonic() - t_start,
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    _plot(args.png, layouts, ttft_slo, itl_slo, args.phase_a_s)
    print(json.dumps({k: out[k] for k in ("goodput_ratio_vs_1to1", "goodput_ratio_vs_best_fixed", "lost",
                                          "best_fixed", "bench_wall_s")}, indent=2))
    return 0


def _plot(path: str, layouts: list[Layout], ttft_slo: float, itl_slo: float, switch_at: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[bench planner] matplotlib is not installed: no {path}", flush=True)
        return
    pl = layouts[-1]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ts = [s["t"] for s in pl.timeline]
    ax1.step(ts, [s["prefill"] for s in pl.timeline], where="post", label="prefill workers")
    ax1.step(ts, [s["decode"] for s in pl.timeline], where="post", label="decode workers")
    ax1.axvline(switch_at, color="grey", ls=":")
    ax1.set_ylabel("workers (planner)")
    ax1.legend()
    for lay in layouts:
        pts = sorted((r.sent, 1.0 if (not r.error and r.tokens >= r.want and r.ttft is not None and r.ttft <= ttft_slo
                                      and (r.itl or 0) <= itl_slo) else 0.0) for r in lay.records)
        win, xs, ys = 10.0, [], []
        for i, (t, _) in enumerate(pts):
            near = [v for u, v in pts if t - win <= u <= t]
            xs.append(t)
            ys.append(sum(near) / len(near))
        ax2.plot(xs, ys, label=lay.name, lw=2.0 if lay.planner else 1.0)
    ax2.axvline(switch_at, color="grey", ls=":")
    ax2.set_ylabel("SLO attainment (10 s window)")
    ax2.set_xlabel("seconds (by request arrival)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"[bench planner] wrote {path}", flush=True)
