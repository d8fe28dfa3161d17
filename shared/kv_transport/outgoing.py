"""One transfer sent in pieces while the prefill that produces it is still computing.

A prefill worker cuts a long prompt into chunks (long_prefill_token_threshold); the engine hands out
the KV blocks each chunk completed, and they go out on the direct channel while the next chunk
computes, so the decode worker waits for the last chunk's blocks only. Pieces go out one after the
other, in order, each one's frames pipelined; frames are numbered across the whole transfer, and
only the final piece's frames carry the total (earlier ones say 0: not known yet).

The NATS fallback numbers chunks of a known total, so when the receiver's direct endpoint cannot be
reached the pieces are kept and go together at the end, as before pieces existed.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from shared.kv_blocks import KVBlocks
from shared.kv_transport.base import DirectUnavailable, TransferError

# send(blocks, deadline_s) over the bus: every block at once (the fallback)
BusSend = Callable[[KVBlocks, float], Awaitable[int]]


class DirectChannel(Protocol):
    """The direct path to a receiver (direct.py's DirectSender), named here by what a transfer uses of it
    so this module does not depend on the channel's implementation."""

    async def connect(self, endpoint: str) -> None: ...

    async def send(self, endpoint: str, token: bytes, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   first_seq: int = 0, final: bool = True) -> int: ...

    def num_frames(self, blocks: KVBlocks) -> int: ...


@dataclass
class PushStats:
    """A sending worker's pushes, cumulative (exported from its load beats)."""
    pushes: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # after the last piece was handed over, until the receiver had every block

    def record(self, nbytes: int, wait_s: float) -> None:
        self.pushes += 1
        self.bytes += nbytes
        self.wait_s += wait_s


@dataclass
class _Piece:
    blocks: KVBlocks
    final: bool


class OutgoingTransfer:
    def __init__(self, transfer_id: str, deadline_s: float, bus_send: BusSend, direct: DirectChannel | None = None,
                 endpoint: str | None = None, token: bytes = b"") -> None:
        self.transfer_id = transfer_id
        self._deadline = time.monotonic() + deadline_s
        self._bus_send = bus_send
        self._direct = direct if endpoint and token else None
        self._endpoint, self._token = endpoint or "", token
        self._queue: asyncio.Queue[_Piece] = asyncio.Queue()
        self._worker = asyncio.ensure_future(self._run())
        self.pieces = 0  # handed over so far
        self.went_direct: bool | None = None  # decided by the first piece
        self.fell_back: str | None = None  # why the bus carried it, when it did

    @property
    def direct_offered(self) -> bool:
        """Whether the receiver has a direct endpoint to try."""
        return self._direct is not None

    def push(self, blocks: KVBlocks) -> None:
        """Hand over the blocks a chunk completed; they go out in order while the caller goes on."""
        self._put(_Piece(blocks, final=False))

    async def finish(self, blocks: KVBlocks) -> int:
        """Hand over the last blocks and wait until every piece is written at the receiver; returns the
        bytes sent. Raises TransferError (or DirectUnavailable's cousins) when any piece failed."""
        self._put(_Piece(blocks, final=True))
        return await asyncio.shield(self._worker)

    def add_done_callback(self, fn: Callable[[bool], None]) -> None:
        """fn(ok) once the transfer is over: ok when every piece was written at the receiver."""
        self._worker.add_done_callback(lambda t: fn(not t.cancelled() and t.exception() is None))

    async def cancel(self) -> None:
        self._worker.cancel()
        await asyncio.gather(self._worker, return_exceptions=True)

    def _put(self, piece: _Piece) -> None:
        if self._worker.done():
            return  # failed already: finish() reports why
        self.pieces += 1
        self._queue.put_nowait(piece)

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"transfer {self.transfer_id} passed its deadline")
        return left

    async def _run(self) -> int:
        kept: list[_Piece] = []  # for the bus, when the direct channel is out of reach
        seq = sent = 0
        while True:
            piece = await self._queue.get()
            if self.went_direct is None:
                self.went_direct = await self._connect()
            if not self.went_direct:
                kept.append(piece)
                if piece.final:
                    return await self._send_kept(kept)
                continue
            assert self._direct is not None
            sent += await self._direct.send(self._endpoint, self._token, self.transfer_id, piece.blocks,
                                            self._left(), first_seq=seq, final=piece.final)
            seq += self._direct.num_frames(piece.blocks)
            if piece.final:
                return sent

    async def _connect(self) -> bool:
        if self._direct is None:
            self.fell_back = "the receiver has no direct endpoint"
            return False
        try:
            await asyncio.wait_for(self._direct.connect(self._endpoint), self._left())
            return True
        except (DirectUnavailable, asyncio.TimeoutError) as e:
            self.fell_back = str(e) or type(e).__name__
            return False

    async def _send_kept(self, kept: list[_Piece]) -> int:
        try:
            blocks = KVBlocks.concat([p.blocks for p in kept])
        except ValueError as e:
            raise TransferError(f"pieces of {self.transfer_id}: {e}") from None
        return await self._bus_send(blocks, self._left())
