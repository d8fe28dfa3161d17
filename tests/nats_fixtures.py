"""Real nats-server fixtures: `from tests.nats_fixtures import nats_server, nats_server_factory`.

Each fixture starts its own server(s) on free ports and kills them on teardown; nothing assumes
a server is already running. The two fixtures do not depend on each other, so a test module can
import either alone.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.bus.natsd import NatsServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[str]:
    """URL of a fresh nats-server with default settings (max_payload 1 MiB)."""
    with NatsServer(workdir=tmp_path) as server:
        yield server.url


@pytest.fixture
def nats_server_factory(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`start(max_payload=None) -> url`; every server it started is stopped after the test."""
    servers: list[NatsServer] = []

    def start(max_payload: int | None = None) -> str:
        server = NatsServer(workdir=tmp_path, max_payload=max_payload)
        servers.append(server)
        return server.start().url

    yield start
    for server in servers:
        server.stop()


async def wait_discoverable(nc, service_name: str, timeout: float = 5.0) -> None:
    """Until `$SRV.PING.<service_name>` is answered over `nc` (the connection clients will use)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await nc.request(f"$SRV.PING.{service_name}", b"", timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - no responders or timeout: not reachable yet
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)
