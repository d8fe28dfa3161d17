"""A KV transport test double: the real NATS transport, except that the last chunk of every transfer is
dropped or sent with a wrong checksum (what a lossy or corrupting network would do)."""
from __future__ import annotations

from shared.kv_transport import NatsKVTransport
from shared.protocol.kvtransfer import KVBlockChunk


def faulty_transport(fault: str) -> type[NatsKVTransport]:
    assert fault in ("drop", "corrupt")

    class FaultyTransport(NatsKVTransport):
        def outgoing(self, chunk: KVBlockChunk) -> KVBlockChunk | None:
            if chunk.seq != chunk.total - 1:
                return chunk
            return None if fault == "drop" else chunk.model_copy(update={"checksum": chunk.checksum ^ 1})

    return FaultyTransport
