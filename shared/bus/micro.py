"""nats.micro registration, so `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` discover kvmesh services.

nats.micro endpoints always subscribe with a queue group (nats-py defaults it to "q"), so only
load-balanced endpoints belong here; fan-out subjects use bus.serve(queue=None) or
bus.subscribe. The micro endpoint callback only hands the message to our Dispatcher (decode,
upload reassembly, trace context, error replies) and returns, so one slow request never
blocks the endpoint; the price is that micro's per-endpoint processing time and error counts
cover the hand-off only.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from nats import micro
from nats.aio.client import Client
from nats.micro.request import Request
from nats.micro.service import Service

from shared import wire
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.server import Dispatcher, Handler


@dataclass(frozen=True)
class Endpoint:
    name: str  # letters, digits, "-" and "_" (nats.micro's rule)
    subject: str
    queue: str
    handler: Handler[Any]
    msg_type: type[wire.Message]
    metadata: dict[str, str] | None = None


@dataclass
class MicroService:
    service: Service
    dispatchers: list[Dispatcher[Any]]

    @property
    def id(self) -> str:
        return self.service.id

    async def stop(self) -> None:
        await self.service.stop()
        for d in self.dispatchers:
            await d.stop()


async def add_micro_service(
    nc: Client,
    name: str,
    version: str,
    endpoints: list[Endpoint],
    *,
    description: str = "",
    metadata: dict[str, str] | None = None,
    limits: BusLimits = DEFAULT_LIMITS,
) -> MicroService:
    """Registers `name` (e.g. subjects.SERVICE_TOKENIZER) with its endpoints and starts serving. Its INFO
    names the host it runs on, so a container's health check can find its own replica among the others
    (shared/launcher/healthcheck.py) without the server's monitoring page."""
    metadata = {"host": socket.gethostname(), **(metadata or {})}
    service = await micro.add_service(nc, name=name, version=version, description=description or None, metadata=metadata)
    dispatchers: list[Dispatcher[Any]] = []
    for ep in endpoints:
        dispatcher = Dispatcher(nc, ep.subject, ep.handler, ep.msg_type, limits)
        dispatchers.append(dispatcher)
        await service.add_endpoint(
            name=ep.name, subject=ep.subject, queue_group=ep.queue, handler=_hand_off(dispatcher), metadata=ep.metadata
        )
    return MicroService(service, dispatchers)


def _hand_off(dispatcher: Dispatcher[Any]):  # noqa: ANN202
    async def handler(request: Request) -> None:
        # Request only exposes subject/headers/data; the reply subject lives on the raw message.
        await dispatcher.on_message(request._msg)

    return handler
