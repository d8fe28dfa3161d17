"""prefill -> decode KV push: a transfer is `total` KVBlockChunks, each acknowledged by a KVChunkAck.

Each chunk carries K and V for a layer range and a block range of one request, as
`tensors = [k(layer_start), v(layer_start), k(layer_start+1), ...]`, each shaped
[block_end - block_start, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import zlib
from typing import ClassVar

from pydantic import model_validator

from shared.wire import Message, WireTensor

CHECKSUM_ALGO = "crc32"


def checksum(tensors: list[WireTensor]) -> int:
    """crc32 over the tensors' bytes in order: cheap, and deterministic across machines."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.data, crc)
    return crc


class KVBlockChunk(Message):
    KIND: ClassVar[str] = "kv.chunk"

    transfer_id: str
    seq: int  # 0 .. total-1
    total: int
    layer_start: int  # [layer_start, layer_end)
    layer_end: int
    block_start: int  # logical block indices within the request, [block_start, block_end)
    block_end: int
    tensors: list[WireTensor]
    checksum: int
    checksum_algo: str = CHECKSUM_ALGO

    @model_validator(mode="after")
    def _ranges(self) -> KVBlockChunk:
        if not (0 <= self.seq < self.total and 0 <= self.layer_start < self.layer_end and 0 <= self.block_start < self.block_end):
            raise ValueError("seq, layer or block range out of order")
        if len(self.tensors) != 2 * (self.layer_end - self.layer_start):
            raise ValueError("expected one K and one V tensor per layer")
        return self

    def verify(self) -> bool:
        return self.checksum_algo == CHECKSUM_ALGO and checksum(self.tensors) == self.checksum


class KVChunkAck(Message):
    """The decode worker's answer to each chunk: flow control, and an early stop on a bad chunk."""

    KIND: ClassVar[str] = "kv.ack"
    transfer_id: str
    seq: int
    ok: bool = True
    error: str | None = None
