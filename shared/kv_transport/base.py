"""How a request's KV blocks travel from a prefill worker to a decode worker.

One interface over every path: NATS chunks, and the direct channel (shared memory or TCP).
The decode side owns the destination blocks: it registers a transfer id with where the blocks go,
and nothing a sender says can name physical block ids.
"""
from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.kv_blocks import KVBlocks

# write(blocks): blocks numbered by their logical index in the request; a chunk may carry a range of
# layers when one block of all layers does not fit in a message.
BlockWriter = Callable[[KVBlocks], Awaitable[None]]


class TransferError(Exception):
    """A transfer failed (timeout, bad checksum, missing chunk, receiver gone); decode recomputes."""


class DirectUnavailable(TransferError):
    """The receiver's endpoint cannot be reached: nothing was sent, another path may be tried."""


class PiecewiseSend(Protocol):
    """A transfer sent in pieces as they are computed (outgoing.py's OutgoingTransfer is the one)."""

    def push(self, blocks: KVBlocks) -> None: ...

    async def finish(self, blocks: KVBlocks) -> int: ...

    def add_done_callback(self, fn: Callable[[bool], None]) -> None: ...

    async def cancel(self) -> None: ...


class KVTransport(abc.ABC):
    endpoint: str | None  # where a sender may push directly (sent in RemotePrefillRequest); None: over the bus

    @abc.abstractmethod
    async def start(self, worker_id: str | None) -> None:
        """Start receiving for worker_id (decode workers); None for send-only (prefill workers)."""

    @abc.abstractmethod
    async def send(self, dest_worker: str, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   endpoint: str | None = None, token: bytes = b"") -> int:
        """Push blocks [first_block, end_block) of a transfer; returns bytes sent.
        endpoint, token: the receiver's direct channel and this transfer's token, when it has one."""

    @abc.abstractmethod
    def open_transfer(self, dest_worker: str, transfer_id: str, deadline_s: float, endpoint: str | None = None,
                      token: bytes = b"") -> PiecewiseSend:
        """A transfer sent in pieces as they are computed (outgoing.py): push() each chunk's blocks,
        finish() with the last ones."""

    @abc.abstractmethod
    def expect(self, transfer_id: str, num_blocks: int, write: BlockWriter, deadline_s: float,
               token: bytes = b"") -> Awaitable[None]:
        """Register an incoming transfer; the awaitable resolves once every block has been written,
        or raises TransferError. token: what a direct-channel sender must present."""

    @abc.abstractmethod
    def forget(self, transfer_id: str) -> None:
        """Drop a registered transfer (request cancelled or given up); late chunks are refused."""

    @abc.abstractmethod
    async def stop(self) -> None: ...
