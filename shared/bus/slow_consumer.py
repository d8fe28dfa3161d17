"""Which subscriptions lost messages because their reader fell behind (a client-side slow consumer).

nats-py drops a message when a subscription's pending queue is full and reports it only to the connection's
error callback. A streamed reply that loses its end marker that way would wait its whole idle timeout (minutes)
for nothing. bus.connect's error callback records the subscription here, and ReplyStream checks it while it
waits, so the stream fails at once (shared/bus/stream.py).
"""
from __future__ import annotations

import weakref

import nats.errors
from nats.aio.subscription import Subscription

_dropped: weakref.WeakSet[Subscription] = weakref.WeakSet()  # forgotten with the subscription


def note(error: Exception) -> None:
    """Called with every error the connection reports."""
    if isinstance(error, nats.errors.SlowConsumerError) and error.sub is not None:
        _dropped.add(error.sub)


def dropped(sub: Subscription) -> bool:
    """Whether the client library dropped messages of this subscription."""
    return sub in _dropped
