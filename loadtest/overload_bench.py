"""`kvmesh bench overload`: the CPU serving scenario that once left most requests unanswered and the engines busy
with work nobody waited for. `kvmesh up --prefill 1 --decode 2` on the SmolLM2 demo, N chat streams at
concurrency C (the openai client, no retries), a fifth given up by their client mid-stream, one decode worker
SIGKILLed mid-run (its supervisor restarts it). Each request ends as:

- answered: its last chunk (a finish_reason) within --deadline seconds of being sent;
- refused: a 429 or 503 OpenAI error object with Retry-After (the gateway's --max-queue-wait and limits);
- cancelled: given up by the client on purpose (the fifth);
- lost: anything else (no answer within the deadline, a broken stream, an error without Retry-After).

Then --settle seconds after the last one, the engines' state from the gateway's /metrics (the workers' own load
beats): requests running and waiting, and KV blocks held (usage x pool size) per worker. A mesh that dropped every
abandoned request holds nothing there.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import httpx
import openai

from loadtest.chat_prompts import questions
from loadtest.report_json import emit_report
from loadtest.up_process import kvmesh_up
from loadtest.workload import machine_info, warn_if_busy

MODEL_NAME = "smollm2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300, help="chat requests in all")
    p.add_argument("--concurrency", type=int, default=32, help="requests open at once")
    p.add_argument("--cancel-every", type=int, default=5, help="every k-th request is given up mid-stream (0: none)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a request may take to be answered")
    p.add_argument("--kill-at", type=float, default=0.3,
                   help="SIGKILL a decode worker once this fraction of the requests has ended (negative: never)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after the last request to read the engines")
    p.add_argument("--port", type=int, default=8031, help="the gateway's port")
    p.add_argument("--kill-worker", default="decode-1", help="the worker to SIGKILL")
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="one more `kvmesh up` argument (repeat), e.g. --up-arg=--max-queue-wait=20")
    p.add_argument("--json", default=None, help="also write the report here")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def _worker_pid(log_path: Path, worker: str) -> int | None:
    """The pid of the process serving `worker`, from the supervisor's "started <name> (pid N)" lines (the last)."""
    pids = re.findall(rf"started {re.escape(worker)} \(pid (\d+)\)", log_path.read_text())
    return int(pids[-1]) if pids else None


def engines(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per worker: running, waiting, and KV blocks held, from the gateway's /metrics text."""
    out: dict[str, dict[str, float]] = {}
    pool: dict[str, int] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'kvmesh:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|cache_config_info)'
                     r'\{([^}]*)\} ([0-9.eE+-]+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        w = labels.get("worker", "?")
        row = out.setdefault(w, {"role": labels.get("role", "")})
        if m[1] == "cache_config_info":
            pool[w] = int(labels.get("num_gpu_blocks", 0))
        else:
            row[m[1].removeprefix("num_requests_")] = float(m[3])
    for w, row in out.items():
        row["blocks_held"] = round(row.pop("kv_cache_usage_perc", 0.0) * pool.get(w, 0))
        row["pool_blocks"] = pool.get(w, 0)
    return out


async def _one(client: openai.AsyncOpenAI, prompt: str, cancel: bool, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    rec: dict = {"cancel": cancel}
    stream = None
    try:
        async with asyncio.timeout(args.deadline):
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                temperature=0, stream=True)
            n = 0
            async for chunk in stream:
                if n == 0:
                    rec["ttft_s"] = time.monotonic() - t0
                n += 1
                if cancel and n == 8:
                    await stream.close()
                    return rec | {"outcome": "cancelled"}
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    return rec | {"outcome": "answered", "e2e_s": time.monotonic() - t0}
            return rec | {"outcome": "lost", "why": "stream ended without a finish_reason"}
    except TimeoutError:
        if stream is not None:  # a client that gives up closes its connection (the gateway then drops the request)
            await stream.close()
        return rec | {"outcome": "lost", "why": f"no answer within {args.deadline:g}s"}
    except openai.APIStatusError as e:
        clean = e.status_code in (429, 503) and "retry-after" in e.response.headers and isinstance(e.body, dict)
        return rec | {"outcome": "refused" if clean else "lost", "status": e.status_code,
                      "retry_after": e.response.headers.get("retry-after"), "code": (e.body or {}).get("code"),
                      "refused_s": time.monotonic() - t0}
    except openai.APIError as e:
        return rec | {"outcome": "lost", "why": f"{type(e).__name__}: {e}"}


async def _load(base_url: str, log_path: Path, args: argparse.Namespace) -> tuple[list[dict], dict]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                timeout=args.deadline + 5)
    prompts = questions(64)
    rng = random.Random(0)
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []
    kill: dict = {}

    async def bounded(i: int) -> None:
        async with sem:
            cancel = args.cancel_every > 0 and i % args.cancel_every == args.cancel_every - 1
            results.append(await _one(client, rng.choice(prompts), cancel, args))

    tasks = [asyncio.create_task(bounded(i)) for i in range(args.requests)]
    t0 = time.monotonic()
    if args.kill_at >= 0:
        while len(results) < args.kill_at * args.requests and not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)
        pid = _worker_pid(log_path, args.kill_worker)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            kill = {"worker": args.kill_worker, "pid": pid, "at_s": round(time.monotonic() - t0, 1),
                    "requests_ended_before": len(results)}
    await asyncio.gather(*tasks)
    kill["run_s"] = round(time.monotonic() - t0, 1)
    await client.close()
    return results, kill


def summarize(results: list[dict]) -> dict:
    count = {k: sum(r["outcome"] == k for r in results) for k in ("answered", "refused", "cancelled", "lost")}
    e2e = [r["e2e_s"] for r in results if "e2e_s" in r]
    ttft = [r["ttft_s"] for r in results if r["outcome"] == "answered" and "ttft_s" in r]
    statuses: dict[str, int] = {}
    for r in results:
        if r["outcome"] == "refused":
            key = f"{r['status']} {r['code']}"
            statuses[key] = statuses.get(key, 0) + 1
    lost_why: dict[str, int] = {}
    for r in results:
        if r["outcome"] == "lost":
            key = r.get("why") or f"{r.get('status')} {r.get('code')}"
            lost_why[key] = lost_why.get(key, 0) + 1
    return {**count, "refusals": statuses, "lost_why": lost_why,
            "e2e_s": {"p50": _pct(e2e, 0.5), "p90": _pct(e2e, 0.9), "p99": _pct(e2e, 0.99), "max": _pct(e2e, 1.0)},
            "ttft_s": {"p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9), "p99": _pct(ttft, 0.99)}}


def run(args: argparse.Namespace) -> int:
    from shared.models.smollm2 import smollm2_checkpoint

    warn_if_busy()
    machine = machine_info("cpu")
    extra = ["--prefill", "1", "--decode", "2", *args.up_arg]
    base_url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="kvmesh-overload-") as tmp:
        with kvmesh_up(smollm2_checkpoint(), args.port, MODEL_NAME, extra, Path(tmp) / "up.log") as (proc, log_path):
            results, kill = asyncio.run(_load(base_url, log_path, args))
            time.sleep(args.settle)
            text = httpx.get(f"{base_url}/metrics", timeout=30).text
            after = engines(text)
            in_flight = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                            if x.startswith("kvmesh:gateway_requests_in_flight{"))
            restarted = any(f"{args.kill_worker} exited" in x and "restarting" in x for x in log_path.read_text().splitlines())
    summary = summarize(results)
    report = {
        "benchmark": "overload",
        "command": "kvmesh up " + " ".join(extra),
        "requests": args.requests, "concurrency": args.concurrency, "cancel_every": args.cancel_every,
        "max_tokens": args.max_tokens, "deadline_s": args.deadline,
        "kill": kill | {"restarted_by_supervisor": restarted},
        **summary,
        f"engines_{args.settle:g}s_after": after,
        f"gateway_in_flight_{args.settle:g}s_after": in_flight,
        "engines_idle": all(r.get("running", 0) == 0 and r.get("waiting", 0) == 0 and r["blocks_held"] == 0
                            for r in after.values()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
    }
    emit_report(report, args.json)
    return 0 if summary["lost"] == 0 and report["engines_idle"] else 1
