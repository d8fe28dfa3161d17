"""Container health check: `python -m shared.launcher.healthcheck <service>`; exit 0 when healthy.

gateway: its /health answers 200. NATS-only services (tokenizer, prefill, decode, kvstore) have no port to
probe, and `$SRV.PING` would be answered by any replica, so the check connects to NATS as the container's
own identity (its NATS_* environment), asks `$SRV.INFO.kvmesh-<service>` and looks for an answer from this
container's host name (every service names it in its INFO metadata, shared/bus/micro.py): that is this
replica, connected and serving. The NATS monitoring page is not needed (it lists every connection and
subscription, so it stays inside the nats-server's own container).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys

import httpx

from shared.launcher.process_spec import SERVICES


async def answers_from_here(service: str, timeout: float, nats_url: str | None = None) -> bool:
    from shared.bus.connect import connect

    nc = await connect(nats_url, connect_timeout=timeout, allow_reconnect=False, max_reconnect_attempts=0)
    try:
        sub = await nc.subscribe(nc.new_inbox())
        await nc.publish(f"$SRV.INFO.kvmesh-{service}", b"", reply=sub.subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        host = socket.gethostname()
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # noqa: BLE001 - nats' TimeoutError: nobody (else) answered
                return False
            try:
                if (json.loads(msg.data).get("metadata") or {}).get("host") == host:
                    return True
            except (ValueError, AttributeError):
                continue
        return False
    finally:
        await nc.close()


def check(service: str, gateway_url: str, timeout: float, nats_url: str | None = None) -> str | None:
    """None when healthy, else why not."""
    try:
        if service == "gateway":
            r = httpx.get(f"{gateway_url.rstrip('/')}/health", timeout=timeout)
            return None if r.status_code == 200 else f"/health: HTTP {r.status_code} {r.text[:200]}"
        if asyncio.run(answers_from_here(service, timeout, nats_url)):
            return None
        return f"no kvmesh-{service} on this host answers $SRV.INFO"
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy", with its reason
        return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.launcher.healthcheck")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("--nats-url", default=None, help="NATS server URL(s) (default: NATS_URL)")
    p.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    problem = check(args.service, args.gateway_url, args.timeout, args.nats_url)
    if problem:
        print(f"{args.service} unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
