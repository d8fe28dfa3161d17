"""What the planner scales through: a small interface ("scale a role to n"), and its implementation for
`kvmesh up`'s supervisor. A container orchestrator goes behind the same interface.

Removing a worker drains it: SIGTERM starts the worker's drain (it takes no new request, lets the running
ones finish within its grace period, and ends the rest with a chunk that tells the gateway to move them to
another worker: shared/protocol/errors.py MOVE_ELSEWHERE), so no request is lost. New workers take the
lowest free instance number, whose bus identity `kvmesh up` created at start.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from shared.launcher.process_spec import ProcessSpec
from shared.launcher.supervisor import Supervisor

log = logging.getLogger(__name__)


class Scaler(Protocol):
    def count(self, role: str) -> int:
        """Workers of the role the scaler runs now (starting ones included, draining ones not)."""

    async def scale(self, role: str, n: int) -> None:
        """Run n workers of the role: start the missing ones, drain the surplus (returns once they are gone)."""


class SupervisorScaler:
    def __init__(self, supervisor: Supervisor, process_for: Callable[[str, int], ProcessSpec],
                 running: dict[str, list[int]], max_index: dict[str, int], drain_timeout_s: float) -> None:
        """process_for(role, index): the process of that instance; running: role -> instance numbers up now;
        max_index: role -> the most instances the bus has identities for."""
        self._sup = supervisor
        self._process_for = process_for
        self._running = {r: sorted(ix) for r, ix in running.items()}
        self._max_index = max_index
        self._drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()

    def count(self, role: str) -> int:
        return len(self._running[role])

    def names(self, role: str) -> list[str]:
        return [self._process_for(role, i).name for i in self._running[role]]

    async def scale(self, role: str, n: int) -> None:
        async with self._lock:
            running = self._running[role]
            while len(running) < n:
                free = next(i for i in range(self._max_index[role] + 1) if i not in running)
                if free >= self._max_index[role]:
                    raise RuntimeError(f"no bus identity left for another {role} worker (max {self._max_index[role]})")
                spec = self._process_for(role, free)
                self._sup.forget(spec.name)  # a stopped earlier instance of the same number
                await self._sup.start(spec)
                running.append(free)
                running.sort()
            while len(running) > n:
                i = running.pop()  # the newest: the longest-running workers keep their warm caches
                name = self._process_for(role, i).name
                codes = await self._sup.stop([name], timeout=self._drain_timeout_s)
                log.info("drained %s (exit %s)", name, codes.get(name))
                self._sup.forget(name)
