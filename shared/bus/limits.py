"""Bounds the bus enforces against slow, broken or hostile peers (configuration, not state)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BusLimits:
    max_message_bytes: int = 256 << 20  # largest logical (reassembled) message
    max_pending_bytes: int = 1 << 30  # all partially reassembled messages of one receiver together
    # ... of them from one sender (its inbox: on a locked-down bus, its identity); 0: a quarter of the above, at
    # least one largest message. One sender's uploads cannot shut the others out.
    max_sender_bytes: int = 0
    reassembly_timeout: float = 30.0  # seconds from a message's first chunk to its last
    max_inflight: int = 1024  # concurrent handler tasks per served subject; beyond it: "overloaded"
    # Messages a streamed reply's inbox holds unread before the client library drops them (then the stream
    # fails: MessagesDroppedError). None: nats-py's default (512 Ki messages).
    reply_pending_msgs: int | None = None

    def __post_init__(self) -> None:
        assert 0 < self.max_message_bytes <= self.max_pending_bytes
        assert 0 <= self.max_sender_bytes <= self.max_pending_bytes

    @property
    def sender_bytes(self) -> int:
        return self.max_sender_bytes or max(self.max_message_bytes, self.max_pending_bytes // 4)
        assert self.reassembly_timeout > 0 and self.max_inflight > 0
        assert self.reply_pending_msgs is None or self.reply_pending_msgs > 0


DEFAULT_LIMITS = BusLimits()

# nats-server's max_pending for the mesh's servers: bytes it buffers for one client before cutting it
# off as a slow consumer (its default is 64 MiB). The kvstore takes every worker's offload puts; each
# worker keeps at most 32 MiB of them in flight (shared/engine/offload.py), so 256 MiB leaves room
# for several workers offloading at once while the kvstore is busy.
SERVER_MAX_PENDING = 256 << 20

# Mesh-state messages a router reads from every worker: each worker publishes only its own, but its own can be
# as large as it likes. They are never chunked and never larger than these: a beat is a few hundred bytes, a
# block event one step's blocks (at most a batch's tokens / block size hashes).
BEAT_MAX_BYTES = 64 << 10
EVENT_MAX_BYTES = 1 << 20
