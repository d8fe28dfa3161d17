"""A service's startup heap is frozen once it serves (shared/service_runner.py): full garbage collections
afterwards walk only what came later, not the engine's modules and imported libraries."""
from __future__ import annotations

import asyncio
import gc

from shared.service_runner import Hosted, Service, run_services
from tests.nats_fixtures import nats_server  # noqa: F401 - fixture


class _Probe(Service):
    """Records the collector's frozen count while serving, then ends the process's run on its own."""

    name = "probe"

    def __init__(self) -> None:
        self.startup = [object() for _ in range(1000)]  # what a service builds before it serves
        self.frozen_while_serving: int | None = None
        self.done = asyncio.Event()

    async def start(self, nc) -> None:  # noqa: ANN001
        asyncio.get_running_loop().call_soon(self._serving)

    def _serving(self) -> None:
        self.frozen_while_serving = gc.get_freeze_count()
        self.done.set()

    async def wait_closed(self) -> None:
        await self.done.wait()

    async def stop_intake(self) -> None:
        return None

    def in_flight(self) -> int:
        return 0

    async def release(self, remaining_s: float) -> None:
        return None


def test_the_startup_heap_is_frozen_once_serving(nats_server) -> None:  # noqa: F811
    gc.unfreeze()
    probe = _Probe()
    try:
        assert asyncio.run(run_services("probe", [Hosted(probe, "kvmesh-probe")], nats_server, grace_s=1)) == 0
        assert probe.frozen_while_serving is not None and probe.frozen_while_serving >= len(probe.startup)
        assert gc.get_freeze_count() >= len(probe.startup)
    finally:
        gc.unfreeze()  # the test process's own heap goes back to the collector
