"""The one error answer every endpoint may send instead of its normal reply (the bus speaks it; the
protocol re-exports it as shared.protocol.errors)."""
from __future__ import annotations

from typing import ClassVar

from shared.wire import Message

# Codes are stable strings so callers can branch on them; the message is for humans.
BAD_REQUEST = "bad_request"  # undecodable or invalid request: do not retry
NOT_FOUND = "not_found"
OVERLOADED = "overloaded"  # retry elsewhere or later
CANCELLED = "cancelled"
TIMEOUT = "timeout"
INTERNAL = "internal"


class ErrorReply(Message):
    KIND: ClassVar[str] = "error"

    code: str
    message: str
