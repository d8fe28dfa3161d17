"""nats-server's CPU under a steady rate of tokenize requests, with kvmesh up's locked-down bus (role users,
subject permissions, allow_responses) and with an open bus, for comparison.

What /tokenize puts on the bus is one request from the gateway to the tokenizer's queue group and one reply;
this drives exactly that traffic (the gateway's identity sending EncodeRequests through bus.request, the
tokenizer's identity answering through bus.serve), without HTTP and without a real tokenizer, so what is
measured is the server's cost (allow_responses keeps a reply permission per request until it is used or
expires). CPU is read from /proc for the nats-server process.

    python -m loadtest.experiments.bus_reply_cpu.bus_reply_cpu --rate 500 --seconds 150 \
        --out loadtest/experiments/bus_reply_cpu/results/bus_reply_cpu_500rps_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from shared import bus, subjects
from shared import protocol as p
from shared.launcher.local_nats import LocalNats, role_passwords


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _answer(req: p.EncodeRequest, ctx: bus.RequestContext) -> p.EncodeReply:  # noqa: ARG001
    return p.EncodeReply(token_ids=list(range(len(req.prompt) // 4)))


async def _drive(srv: LocalNats, rate: float, seconds: float, pid: int) -> dict[str, float]:
    def creds(role: str) -> dict[str, str]:
        if not srv.passwords:
            return {}
        return {"user": role, "password": srv.passwords[role], "inbox_prefix": f"_INBOX.{role}"}
    tokenizer = await bus.connect(srv.url, **creds("tokenizer"))
    gateway = await bus.connect(srv.url, **creds("gateway"))
    served = await bus.serve(tokenizer, subjects.TOKENIZER_ENCODE, subjects.QUEUE_TOKENIZER, _answer, p.EncodeRequest)
    await tokenizer.flush()
    request = p.EncodeRequest(prompt="The quick brown fox jumps over the lazy dog. " * 4)
    done, failed = 0, 0

    async def one() -> None:
        nonlocal done, failed
        try:
            await bus.request(gateway, subjects.TOKENIZER_ENCODE, request, timeout=10)
            done += 1
        except Exception:  # noqa: BLE001 - counted, the run goes on
            failed += 1
    try:
        for _ in range(50):  # warm up
            await one()
        done = failed = 0
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        sent = 0
        windows: list[float] = []  # nats-server CPU percent per 10 s (allow_responses entries pile up for 2 min)
        mark, mark_cpu = 0.0, cpu0
        while (now := time.monotonic() - t0) < seconds:
            if now - mark >= 10:
                c = _cpu_seconds(pid)
                windows.append(round(100 * (c - mark_cpu) / (now - mark), 1))
                mark, mark_cpu = now, c
            while sent < now * rate:
                task = asyncio.ensure_future(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        wall, cpu = time.monotonic() - t0, _cpu_seconds(pid) - cpu0
    finally:
        await served.stop()
        await gateway.close()
        await tokenizer.close()
    return {"requests": done, "failed": failed, "seconds": round(wall, 2), "achieved_rate": round(done / wall, 1),
            "nats_cpu_seconds": round(cpu, 3), "nats_cpu_percent": round(100 * cpu / wall, 1),
            "nats_cpu_us_per_request": round(1e6 * cpu / max(done, 1), 1), "nats_cpu_percent_per_10s": windows}


def run(rate: float, seconds: float) -> dict[str, object]:
    out: dict[str, object] = {"rate": rate, "seconds": seconds, "load_average": os.getloadavg(),
                              "cpus": os.cpu_count()}
    for name, passwords in (("locked_down", role_passwords()), ("open_bus", None)):
        with tempfile.TemporaryDirectory() as d:
            srv = LocalNats.on_free_ports(passwords=passwords, config_dir=Path(d))
            proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                assert asyncio.run(srv.wait_ready(15)), "nats-server did not start"
                out[name] = asyncio.run(_drive(srv, rate, seconds, proc.pid))
            finally:
                proc.terminate()
                proc.wait(5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args()
    result = run(args.rate, args.seconds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
