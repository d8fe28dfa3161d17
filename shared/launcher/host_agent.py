"""A joined host's agent: the launcher of `kvmesh up --join` starts or drains its own workers when the planner
on the first host asks (shared/planner/remote_scaler.py), through the same SupervisorScaler a local planner
uses. It and the planner are bus users of their own, allowed only this control subject and their inboxes."""
from __future__ import annotations

import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from shared.bus.roles import RESPONSES, inbox_prefix
from shared.planner.remote_scaler import (AGENT_USER_PREFIX, PLANNER_USER, SUBJECT_ROOT, ScaleReply, ScaleRequest,
                                          scale_subject)
from shared.planner.scaler import SupervisorScaler

log = logging.getLogger(__name__)


def agent_user(host_tag: str) -> str:
    return f"{AGENT_USER_PREFIX}{host_tag}"


def agent_entry(host_tag: str, password: str) -> dict:
    """nats-server's user entry of a host's agent: it reads its host's control subject and answers."""
    user = agent_user(host_tag)
    return {"user": user, "password": password,
            "permissions": {"publish": {"allow": []},
                            "subscribe": {"allow": [scale_subject(host_tag), f"{inbox_prefix(user)}.>"]},
                            "allow_responses": dict(RESPONSES)}}


def planner_entry(password: str) -> dict:
    """nats-server's user entry of the planner: it may ask any joined host to scale, and read its inbox."""
    return {"user": PLANNER_USER, "password": password,
            "permissions": {"publish": {"allow": [f"{SUBJECT_ROOT}.*.scale"]},
                            "subscribe": {"allow": [f"{inbox_prefix(PLANNER_USER)}.>"]}}}


class HostAgent:
    def __init__(self, nc: Client, host_tag: str, scaler: SupervisorScaler) -> None:
        self.nc, self.host_tag, self.scaler = nc, host_tag, scaler
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(scale_subject(self.host_tag), cb=self._on_scale)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        await self.nc.drain()

    async def _on_scale(self, msg: Msg) -> None:
        try:
            req = ScaleRequest.model_validate_json(msg.data)
        except ValidationError as e:
            await msg.respond(ScaleReply(role="", error=f"bad scale request: {e.errors()[0]['msg']}")
                              .model_dump_json().encode())
            return
        error = None
        if req.n is not None:
            try:
                await self.scaler.scale(req.role, req.n)
                log.info("host %s now runs %d %s workers", self.host_tag, self.scaler.count(req.role), req.role)
            except RuntimeError as e:
                error = str(e)
        await msg.respond(ScaleReply(role=req.role, count=self.scaler.count(req.role), error=error)
                          .model_dump_json().encode())
