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
