"""Scaling workers on another host: the planner's Scaler (scaler.py) as requests to that host's launcher.

A host that joined the mesh (`kvmesh up --join`) serves `kvmesh.hosts.<tag>.scale` (shared/launcher/
host_agent.py): "run n workers of this role here", answered once they run (or are drained) with the count.
The planner on the first host (`kvmesh up --planner ... --planner-host TAG`) scales that host's workers through
RemoteHostScaler. The subject is readable only by that host's agent and writable only by the planner: both
are bus users of their own (shared/launcher/local_nats.py `extra_users`), with passwords derived from the mesh
secret like every other process's.
"""
from __future__ import annotations

import asyncio
from typing import Literal

from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from pydantic import BaseModel, ConfigDict, Field

SUBJECT_ROOT = "kvmesh.hosts"
AGENT_USER_PREFIX = "hostagent-"
PLANNER_USER = "planner"


def scale_subject(host_tag: str) -> str:
    return f"{SUBJECT_ROOT}.{host_tag}.scale"


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    n: int | None = Field(default=None, ge=0)  # None: only report the count


class ScaleReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    count: int = 0
    error: str | None = None  # the host could not do it (no identity left for another worker, ...)


class RemoteScaleError(RuntimeError):
    """The host did not scale: it is unreachable, or it answered with an error."""


class RemoteHostScaler:
    """Scaler for the workers of one joined host. count() is what the host last reported."""

    def __init__(self, nc: Client, host_tag: str, counts: dict[str, int], timeout_s: float = 120.0) -> None:
        self._nc = nc
        self.host_tag = host_tag
        self._counts = dict(counts)
        self._timeout_s = timeout_s  # starting a worker is quick; draining one takes up to its grace period
        self._lock = asyncio.Lock()

    def count(self, role: str) -> int:
        return self._counts.get(role, 0)

    async def refresh(self) -> None:
        """Ask the host what it runs now (the planner's starting counts)."""
        for role in ("prefill", "decode"):
            await self._ask(role, None)

    async def scale(self, role: str, n: int) -> None:
        await self._ask(role, n)

    async def _ask(self, role: str, n: int | None) -> None:
        async with self._lock:
            body = ScaleRequest(role=role, n=n).model_dump_json().encode()  # type: ignore[arg-type]
            try:
                msg = await self._nc.request(scale_subject(self.host_tag), body, timeout=self._timeout_s)
            except (NoRespondersError, NatsTimeout) as e:
                raise RemoteScaleError(f"host {self.host_tag} did not answer: {type(e).__name__}") from None
            reply = ScaleReply.model_validate_json(msg.data)
            self._counts[role] = reply.count
            if reply.error:
                raise RemoteScaleError(f"host {self.host_tag}: {reply.error}")
