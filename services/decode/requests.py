"""The requests a decode worker is serving, and the cancels that arrived before their request.

Generate and cancel messages are handled by separate tasks, so a client that gives up at once can
have its cancel processed before its request: such cancels are remembered (a bounded number) and the
request is refused when it arrives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import trace

from shared.bus.stream import StreamReply
from shared.protocol.generate import GenerateRequest
from services.decode.admission import Admission
from services.early_cancels import EarlyCancels


@dataclass
class DecodeRequest:
    """A request this worker serves: its reply stream, its span, its admission, how far it streamed."""

    req: GenerateRequest
    stream: StreamReply
    span: trace.Span
    admission: Admission | None = None
    next_seq: int = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass
class RequestTable:
    active: dict[str, DecodeRequest] = field(default_factory=dict)
    _early_cancels: EarlyCancels = field(default_factory=EarlyCancels)

    def __contains__(self, rid: str) -> bool:
        return rid in self.active

    def __len__(self) -> int:
        return len(self.active)

    def get(self, rid: str) -> DecodeRequest | None:
        return self.active.get(rid)

    def add(self, r: DecodeRequest) -> None:
        self.active[r.request_id] = r

    def pop(self, rid: str) -> DecodeRequest | None:
        return self.active.pop(rid, None)

    def ids(self) -> list[str]:
        return list(self.active)

    def remember_cancel(self, rid: str) -> None:
        self._early_cancels.remember(rid)

    def was_cancelled(self, rid: str) -> bool:
        """True once for a request whose cancel came first."""
        return self._early_cancels.take(rid)
