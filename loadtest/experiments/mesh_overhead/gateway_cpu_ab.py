"""Gateway CPU per streamed token, A/B in one run: the working tree's gateway against another revision's.

One real nats-server and one `kvmesh up --engine sim` (simulated decode workers, a tokenizer, its own gateway left
idle) on it, plus two gateway processes on the same bus, one run from the working tree and one from
`git archive <rev>`, so both hear the same beats and block events and talk to the same workers. Rounds alternate (A B B A ...): N closed-loop
streams through one gateway for --round-s seconds; its figure is the gateway process's CPU (utime + stime from
/proc) over the round per output token the client received. The machine is shared, so only ratios from rounds of
one run mean anything; the JSON keeps every round.

    python -m loadtest.experiments.mesh_overhead.gateway_cpu_ab --before HEAD --json loadtest/results/gateway_cpu_ab.json
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from loadtest.retry import retry_delay_s
from loadtest.lean_http import LeanConnection
from loadtest.scale_bench import _stream_lean
from loadtest.sim_mesh import READY, cpu_seconds, free_port
from shared.bus.natsd import NatsServer

ROOT = Path(__file__).resolve().parents[3]


def _export(rev: str, dest: Path) -> Path:
    """The tree of `rev` under dest (no checkout: the working tree stays as it is)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest)  # noqa: S202 - our own repository's tree
    return dest


def _reader(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.rstrip("\n"))


def _wait(lines: list[str], proc: subprocess.Popen, pattern, timeout: float) -> str:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines:
            if m := pattern.search(line):
                return m[1]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError("did not start:\n" + "\n".join(lines[-30:]))


async def _round(base: str, streams: int, seconds: float, pid: int, osl: int, vocab: int, seed: int,
                 drain_s: float = 60.0) -> dict:
    rng = random.Random(seed)
    results = []
    stop = asyncio.Event()

    # The lean client (loadtest/lean_http.py): httpx cost ~0.55 ms of CPU per token, and at thousands of streams
    # the load generator starved the gateways it measured.
    async def loop() -> None:
        conn = LeanConnection(base, timeout_s=120.0)
        try:
            while not stop.is_set():
                r = await _stream_lean(conn, [rng.randrange(10, vocab - 10) for _ in range(64)], osl)
                if measuring:
                    results.append(r)
                if r.error:
                    await asyncio.sleep(retry_delay_s(r.retry_after, 0, rng))
        finally:
            conn.close()

    measuring = False
    tasks = [asyncio.create_task(loop()) for _ in range(streams)]
    await asyncio.sleep(3.0)  # every stream running
    measuring = True
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    measuring = False
    stop.set()
    await asyncio.wait(tasks, timeout=drain_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # Tokens of the requests that ended inside the window: a slight undercount at both ends, alike for A and B.
    tokens = sum(r.tokens for r in results if not r.error)
    return {"cpu_s": cpu1 - cpu0, "wall_s": t1 - t0, "tokens": tokens, "errors": sum(1 for r in results if r.error),
            "error_examples": sorted({r.error for r in results if r.error})[:3],
            "cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / tokens if tokens else None,
            "gateway_cores": (cpu1 - cpu0) / (t1 - t0)}


def main(argv: list[str] | None = None) -> int:
    from loadtest.sim_model import build_sim_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="HEAD", help="git revision of the B gateway (default HEAD)")
    p.add_argument("--json", required=True)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--round-s", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=4, help="rounds per gateway")
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--speed", type=float, default=0.2, help="the simulated workers' --sim-speed")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="after a round, how long its requests may run on before they are cancelled")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="run the B gateway under cProfile and write its stats here (its CPU figures then include "
                        "the profiler's cost: use for where the time goes, not for the ratio)")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kvmesh-gw-ab-"))
    model = build_sim_model(work / "model")
    vocab = min(json.loads((model / "config.json").read_text())["vocab_size"], 2000)
    before = _export(args.before, work / "before")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "KVMESH_", "OTEL_"))}
    procs: list[subprocess.Popen] = []
    with NatsServer() as nats:
        try:
            env["NATS_URL"] = nats.url
            lines_a: list[str] = []
            up = subprocess.Popen(
                [sys.executable, "-m", "shared.cli", "up", "--engine", "sim", "--model", str(model),
                 "--served-model-name", "sim", "--kvstore", "0", "--port", str(free_port()), "--decode",
                 str(args.decode), "--prefill", "0", "--sim-workers-per-process", str(args.decode),
                 "--sim-speed", f"{args.speed:g}", "--log-level", "warning"],
                cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True)
            procs.append(up)
            threading.Thread(target=_reader, args=(up, lines_a), daemon=True).start()
            _wait(lines_a, up, READY, 240)  # workers up (the mesh's own gateway idles: both measured ones are ours)
            import httpx

            def gateway(tree: Path, lines: list[str]) -> tuple[str, int]:
                port = free_port()
                # Input-lag admission off on both: this loaded machine's lag refused at random, and a round of
                # refusals is no measure of the CPU a streamed token costs. The in-flight bound above the streams
                # for the same reason (its Retry-After follows each gateway's own backlog: rounds of 2,000 streams
                # against the default 1,024 differed by 2.5x in tokens from the refused streams' waits alone).
                proc = subprocess.Popen(
                    [sys.executable, *(["-m", "cProfile", "-o", str(Path(args.profile).resolve())]
                                       if args.profile and tree == before else []),
                     "-m", "services.gateway", "--model", str(model), "--served-model-name", "sim", "--port",
                     str(port), "--max-input-lag", "0", "--max-inflight-requests", str(args.streams + 64),
                     "--log-level", "warning"],
                    cwd=tree, env={**env, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
                procs.append(proc)
                threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
                base = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 90
                while True:
                    try:
                        if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                            return base, proc.pid
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"gateway from {tree} did not start:\n" + "\n".join(lines[-30:]))
                    time.sleep(0.5)

            lines_b: list[str] = []
            lines_after: list[str] = []
            base_a, pid_a = gateway(ROOT, lines_after)
            base_b, pid_b = gateway(before, lines_b)
            gateways = {"after": (base_a, pid_a), "before": (base_b, pid_b)}
            runs: dict[str, list[dict]] = {"after": [], "before": []}
            order = ["before", "after"]
            for r in range(args.rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    base, pid = gateways[name]
                    res = asyncio.run(_round(base, args.streams, args.round_s, pid, args.osl, vocab, r, args.drain_s))
                    res["loadavg_1m"] = os.getloadavg()[0]
                    runs[name].append(res)
                    print(f"round {r} {name:6s} {json.dumps(res)}", flush=True)
            logs = {"after": lines_after[-40:], "before": lines_b[-40:]}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 2)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    # Per token; and per second (with a very slow simulated GPU few requests end in a round: then the gateway's
    # cores with the streams open is the figure, e.g. what waiting streams cost it).
    med = {k: statistics.median([x["cpu_ms_per_token"] for x in v if x["cpu_ms_per_token"]] or [float("nan")])
           for k, v in runs.items()}
    cores = {k: statistics.median(x["gateway_cores"] for x in v) for k, v in runs.items()}
    out = {"command": "python -m loadtest.experiments.mesh_overhead.gateway_cpu_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
           "before_rev": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.before], capture_output=True,
                                        text=True).stdout.strip(),
           "config": vars(args), "median_gateway_cpu_ms_per_token": med,
           "before_over_after": med["before"] / med["after"],
           "median_gateway_cores": cores, "cores_before_over_after": cores["before"] / cores["after"],
           "machine": {"cpu_count": os.cpu_count(), "loadavg_1m_5m_15m": list(os.getloadavg()),
                       "note": "2-core machine shared with other helpers: only the ratio of interleaved rounds counts"},
           "runs": runs, "gateway_log_tails": logs}
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"median_gateway_cpu_ms_per_token": med, "before_over_after": out["before_over_after"],
                      "median_gateway_cores": cores, "cores_before_over_after": out["cores_before_over_after"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
