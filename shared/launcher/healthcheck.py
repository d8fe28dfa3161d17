"""Container health check: `python -m shared.launcher.healthcheck <service>`; exit 0 when healthy.

gateway: its /health answers 200. NATS-only services (tokenizer, prefill, decode, kvstore) have
no port to probe, and `$SRV.PING` would be answered by any replica, so the check asks the NATS
server's monitoring endpoint (/connz) whether a connection named `kvmesh-<service>` comes from
this container's own addresses: that is this replica, connected and serving.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import httpx

from shared.launcher.spec import SERVICES

DEFAULT_MONITOR_URL = "http://127.0.0.1:8222"


def own_addresses() -> set[str]:
    addresses = {"127.0.0.1", "::1"}
    try:
        addresses.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return addresses


def connected(monitor_url: str, service: str, addresses: set[str], timeout: float) -> bool:
    r = httpx.get(f"{monitor_url.rstrip('/')}/connz", params={"limit": 4096}, timeout=timeout)
    r.raise_for_status()
    name = f"kvmesh-{service}"
    return any(c.get("name") == name and c.get("ip") in addresses for c in r.json().get("connections") or [])


def check(service: str, monitor_url: str, gateway_url: str, timeout: float) -> str | None:
    """None when healthy, else why not."""
    try:
        if service == "gateway":
            r = httpx.get(f"{gateway_url.rstrip('/')}/health", timeout=timeout)
            return None if r.status_code == 200 else f"/health: HTTP {r.status_code} {r.text[:200]}"
        if connected(monitor_url, service, own_addresses(), timeout):
            return None
        return f"no NATS connection named kvmesh-{service} from this host ({monitor_url}/connz)"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.launcher.healthcheck")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("--monitor-url", default=os.environ.get("NATS_MONITOR_URL", DEFAULT_MONITOR_URL),
                   help="NATS monitoring endpoint (env NATS_MONITOR_URL)")
    p.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    problem = check(args.service, args.monitor_url, args.gateway_url, args.timeout)
    if problem:
        print(f"{args.service} unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
