"""KV transfer as a stream of KVBlockChunks over NATS, each under the server's max_payload.

Every chunk is a request to the decode worker's push subject and is acknowledged after the decode
side verified its checksum and wrote it into the reserved blocks; at most `window` chunks are
unacknowledged at a time (flow control). A failed chunk stops the transfer on both sides.
Decode writes chunks on its engine thread between steps, so the window is wide enough for most of
a transfer to land at one step boundary rather than a few chunks per step.
"""
from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.kv_transport.base import BlockWriter, KVTransport, TransferError
from shared.kv_transport.incoming import TransferRegistry
from shared.kv_transport.outgoing import BusSend, OutgoingTransfer
from shared.kv_transport.plan import plan_chunks
from shared.protocol.kvtransfer import KVBlockChunk, KVChunkAck, checksum
from shared.kv_blocks import KVBlocks

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.kv_transport")

class NatsKVTransport(KVTransport):
    endpoint: str | None = None  # no direct channel: every byte goes over NATS
    def __init__(self, nc: Client, window: int = 32, registry: TransferRegistry | None = None) -> None:
        self.nc = nc
        self.window = window
        self.registry = registry or TransferRegistry()
        self._served: bus.Served | None = None

    async def start(self, worker_id: str | None) -> None:
        if worker_id is not None:
            self._served = await bus.serve(self.nc, subjects.decode_kv_push(worker_id), None, self._on_chunk,
                                           KVBlockChunk)
            # A round trip to the server: once it answers, the subscription is registered there, so a
            # sender on another connection can no longer get "no responders" for this worker.
            await self.nc.flush()

    async def stop(self) -> None:
        if self._served is not None:
            await self._served.stop()
        self.registry.fail_all("receiver stopped")

    # --- sending (prefill side) -------------------------------------------------------------------

    def open_transfer(self, dest_worker: str, transfer_id: str, deadline_s: float, endpoint: str | None = None,
                      token: bytes = b"") -> OutgoingTransfer:
        """Over NATS the pieces are kept and sent together at the end (chunks are numbered of a known total)."""
        return OutgoingTransfer(transfer_id, deadline_s, self._bus_send(dest_worker, transfer_id))

    def _bus_send(self, dest_worker: str, transfer_id: str) -> BusSend:
        async def send(blocks: KVBlocks, deadline_s: float) -> int:
            return await NatsKVTransport.send(self, dest_worker, transfer_id, blocks, deadline_s)
        return send

    def outgoing(self, chunk: KVBlockChunk) -> KVBlockChunk | None:
        """The chunk as it goes on the wire (a seam for network test doubles; None: not sent)."""
        return chunk

    async def send(self, dest_worker: str, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   endpoint: str | None = None, token: bytes = b"") -> int:
        layers, n = blocks.num_layers, blocks.num_blocks
        per_block_layer = blocks.bytes_per_block // layers
        chunks = plan_chunks(layers, n, per_block_layer, self.nc.max_payload)
        subject = subjects.decode_kv_push(dest_worker)
        window = asyncio.Semaphore(self.window)
        sent = 0
        deadline = time.monotonic() + deadline_s

        async def one(seq: int, l0: int, l1: int, b0: int, b1: int) -> None:
            nonlocal sent
            part = blocks.blocks(b0, b1).layers(l0, l1)
            tensors = part.to_layer_tensors()
            chunk = self.outgoing(KVBlockChunk(
                transfer_id=transfer_id, seq=seq, total=len(chunks), layer_start=part.first_layer,
                layer_end=part.first_layer + part.num_layers, block_start=part.first_block, block_end=part.end_block,
                tensors=tensors, checksum=checksum(tensors)))
            if chunk is None:
                return
            async with window:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"transfer {transfer_id} passed its deadline")
                ack = await bus.request(self.nc, subject, chunk, timeout=remaining, expect=KVChunkAck)
                if not ack.ok:
                    raise TransferError(f"decode refused chunk {seq} of {transfer_id}: {ack.error}")
                sent += sum(len(t.data) for t in tensors)

        with _tracer.start_as_current_span("kv.transfer.send", attributes={
            "kvmesh.transfer_id": transfer_id, "kvmesh.kv.blocks": n, "kvmesh.kv.chunks": len(chunks)}) as span:
            tasks = [asyncio.ensure_future(one(i, *c)) for i, c in enumerate(chunks)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
            span.set_attribute("kvmesh.kv.bytes", sent)
        return sent

    # --- receiving (decode side) ------------------------------------------------------------------

    def expect(self, transfer_id: str, num_blocks: int, write: BlockWriter, deadline_s: float,
               token: bytes = b"") -> asyncio.Future:
        return self.registry.expect(transfer_id, num_blocks, write, deadline_s, token)

    def forget(self, transfer_id: str) -> None:
        self.registry.forget(transfer_id)

    async def _on_chunk(self, chunk: KVBlockChunk, ctx: bus.RequestContext) -> KVChunkAck:
        with _tracer.start_as_current_span("kv.transfer.receive", attributes={
                "kvmesh.transfer_id": chunk.transfer_id, "kvmesh.kv.chunk": chunk.seq}):
            inc, error = self.registry.check(chunk.transfer_id, chunk.seq, chunk.total, chunk.block_end)
            if inc is not None and not chunk.verify():
                inc, error = None, f"checksum mismatch on chunk {chunk.seq}"
            if inc is not None:
                try:
                    got = KVBlocks.from_layer_tensors(chunk.tensors, chunk.block_start, chunk.layer_start)
                    if got.num_blocks != chunk.block_end - chunk.block_start:
                        raise ValueError(f"{got.num_blocks} blocks in a chunk of [{chunk.block_start}, {chunk.block_end})")
                except ValueError as e:
                    got, error = None, f"bad chunk {chunk.seq}: {e}"
                    self.registry.refuse(chunk.transfer_id, error)
                if got is not None:
                    error = await self.registry.accept(chunk.transfer_id, inc, chunk.seq, chunk.total, got)
            elif error != "unknown transfer":
                self.registry.refuse(chunk.transfer_id, error or "refused")
            if error is not None:
                return KVChunkAck(transfer_id=chunk.transfer_id, seq=chunk.seq, ok=False, error=error)
            return KVChunkAck(transfer_id=chunk.transfer_id, seq=chunk.seq)
