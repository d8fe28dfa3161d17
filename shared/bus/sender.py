"""Who sent a reply. A process that answers requests for a known identity (a decode worker, by its worker
id) names itself in a header on every message it sends, and a requester that knows whom it asked accepts
that stream's messages only from it: a message from anyone else is ignored, so a forged chunk can neither
end nor rewrite the stream. (On a locked-down bus nobody else can publish to the inbox at all,
shared/bus/roles.py; this is the requester's own check, which holds on an open bus too as long as the
forger does not know whom the request went to.)"""
from __future__ import annotations

from nats.aio.client import Client

_ATTR = "_kvmesh_sender"


def set_sender(nc: Client, name: str) -> None:
    """Every message sent through the bus on `nc` from now on names `name` as its sender."""
    setattr(nc, _ATTR, name)


def sender_of(nc: Client) -> str | None:
    return getattr(nc, _ATTR, None)
