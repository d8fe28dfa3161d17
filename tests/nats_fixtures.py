"""Real nats-server fixtures: `from tests.nats_fixtures import nats_server, nats_server_factory`, and
`locked_nats(tmp_path, passwords)` for a server locked down as `kvmesh up` locks its own.

Each fixture starts its own server(s) on free ports and kills them on teardown; nothing assumes
a server is already running. The two fixtures do not depend on each other, so a test module can
import either alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.bus.natsd import NatsServer
from shared.launcher.local_nats import LocalNats


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


@contextlib.contextmanager
def locked_nats(config_dir: Path, passwords: dict[str, str]) -> Iterator[LocalNats]:
    """A nats-server on free ports with the mesh's accounts and per-role (or per-identity) permissions
    (shared/launcher/local_nats.py), each user with its password; stopped on exit."""
    srv = LocalNats.on_free_ports(passwords=passwords, config_dir=config_dir)
    proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert asyncio.run(srv.wait_ready(15))
        yield srv
    finally:
        proc.terminate()
        proc.wait(5)


async def wait_discoverable(nc, service_name: str, timeout: float = 5.0) -> None:
    """Until `$SRV.PING.<service_name>` is answered over `nc` (the connection clients will use)."""
    await wait_responders(nc, f"$SRV.PING.{service_name}", timeout)


async def wait_responders(nc, subject: str, timeout: float = 5.0) -> None:
    """Until a request on `subject` over `nc` is answered. With the mesh's accounts a subscription made and
    flushed on one connection can still be unknown to another account's requests for a moment (seen under load:
    a no-responders status); an empty request answered with an error counts as answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await nc.request(subject, b"", timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - no responders or timeout: not reachable yet
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)
