"""What bus calls raise. Everything derives from BusError so callers can catch one type."""
from __future__ import annotations


class BusError(Exception):
    """A message could not be delivered, reassembled or answered."""


class NoRespondersError(BusError):
    """Nobody subscribes to the subject; NATS says so at once, so this never waits for a timeout."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject!r}")
        self.subject = subject


class BusTimeout(BusError, TimeoutError):
    def __init__(self, subject: str, timeout: float, what: str = "reply") -> None:
        super().__init__(f"no {what} on {subject!r} within {timeout:g}s")
        self.subject = subject
        self.timeout = timeout


class ChunkError(BusError):
    """Chunk framing that cannot be reassembled: bad headers, gaps, oversize, or too slow."""


class StreamGapError(BusError):
    """A streamed reply skipped a sequence number, i.e. messages were lost (slow consumer)."""


class MessagesDroppedError(BusError):
    """This receiver fell behind: the client library dropped messages of the stream from its full queue
    (shared/bus/slow_consumer.py). Unlike a gap seen in the sequence, the receiver itself is overloaded."""


class RemoteError(BusError):
    """The responder answered with an ErrorReply; `code` is one of shared.bus.error_reply's codes."""

    def __init__(self, code: str, message: str, subject: str = "") -> None:
        where = f" from {subject!r}" if subject else ""
        super().__init__(f"{code}{where}: {message}")
        self.code = code
        self.message = message
        self.subject = subject
