"""The direct KV channel: bulk KV bytes from a prefill worker straight to a decode worker, off NATS.

The decode worker listens on a TCP port and says where in every RemotePrefillRequest (over the
locked-down bus), with a random per-transfer token; a frame without the token is refused. The prefill
worker keeps one connection per decode worker. On its first frame it offers a shared-memory ring
(shm_ring.py); when the receiver can map it (same host, same /dev/shm), payloads go through the ring
and only headers cross the socket (no checksum: memory is not a lossy channel), else they travel
inline, checked with xxh3. Frames of one transfer are pipelined (a
window of them in flight, acked once written into the KV cache), and several transfers share a
connection. A connection that cannot be opened is DirectUnavailable (the caller falls back to NATS);
one that breaks mid-transfer fails that transfer (decode computes the prompt itself).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np
import torch
from opentelemetry import propagate, trace

from shared.kv_transport import shm_ring
from shared.kv_transport.base import DirectUnavailable, TransferError
from shared.kv_transport.frames import (FrameError, as_bytes, digest, discard, header, kv_views, recv_header,
                                        recv_into, send_all)
from shared.kv_transport.incoming import TransferRegistry
from shared.kv_blocks import KVBlocks
from shared.kv_transport.plan import plan_chunks

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.kv_transport")


@dataclass(frozen=True)
class DirectSettings:
    # Payload per frame: big enough to amortize a round trip through both event loops, small enough to
    # pipeline (the sender fills frame i+1 while the receiver empties frame i). Measured on the CPU
    # machine, two processes, shared memory, 33.6 MB: 1 MiB 3.3 GB/s, 2 MiB 3.8-4.5, 4 MiB 4.8-5.2,
    # 8 MiB 4.9-5.9, 16 MiB 5.1; 4 MiB x 8 slots keeps the ring (populated memory) at 32 MiB.
    frame_bytes: int = 4 << 20
    slots: int = 8  # frames in flight per connection (shared-memory slots, or inline frames)
    max_frame_bytes: int = 256 << 20  # the receiver refuses bigger frames (a bound on its memory)
    shared_memory: bool = True  # offer a ring when the peer may share the host
    # Any local process can connect to the listener. A connection must say hello within this long, and at
    # most max_connections are held: past that, the oldest one that never carried a frame with a valid
    # transfer token makes way (a prefill worker keeps one connection per decode worker; strangers cannot
    # crowd them out), or the newcomer is closed when every held one has proved itself.
    handshake_timeout_s: float = 5.0
    max_connections: int = 64


def same_host(address: str) -> bool:
    """Whether an IP address is this host's own (loopback, or bound to one of this network namespace's
    interfaces): only then may a peer share memory with us. A peer on another host, or in another network
    namespace on the same kernel (which still sees the same /dev/shm), gets TCP: separate hosts never share
    memory, so a mesh spread over hosts moves KV the same way in tests as in production."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    u = urlsplit(endpoint)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise DirectUnavailable(f"not a tcp://host:port endpoint: {endpoint!r}")
    return u.hostname, u.port


# --------------------------------------------------------------------------- receiving (decode side)


class _Buffers:
    """Receive buffers of one connection, kept for the next frames: a fresh 16 MiB bytearray per frame
    paid its page faults every time (inline frames over TCP loopback, two processes: ~1.0 -> ~1.3 GB/s
    with reuse). At most `keep` are kept, about the sender's window."""

    def __init__(self, keep: int) -> None:
        self.keep, self._free = keep, []

    def take(self, nbytes: int) -> bytearray:
        for i, buf in enumerate(self._free):
            if len(buf) >= nbytes:
                return self._free.pop(i)
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)


class DirectServer:
    def __init__(self, registry: TransferRegistry, host: str, port: int = 0,
                 settings: DirectSettings = DirectSettings()) -> None:
        self.registry, self.host, self.port, self.settings = registry, host, port, settings
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self._unproven: dict[asyncio.Task, None] = {}  # connections without an authorized frame yet, oldest first
        self.refused_connections = 0  # closed at once or evicted for room (the cap), for tests and metrics
        self.frames = 0  # received, for tests and metrics
        self.shm_frames = 0

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept_loop())
        return self.port

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if len(self._conns) >= self.settings.max_connections:
                self.refused_connections += 1
                if not self._unproven:
                    log.warning("direct KV: %d connections held, all carrying transfers; refusing another",
                                len(self._conns))
                    conn.close()
                    continue
                oldest = next(iter(self._unproven))
                self._unproven.pop(oldest)
                oldest.cancel()
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(conn))
            self._conns.add(task)
            self._unproven[task] = None
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._conns.discard(task)
        self._unproven.pop(task, None)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()  # one writer of acks at a time
        frames: set[asyncio.Task] = set()
        ring: shm_ring.ShmView | None = None
        buffers = _Buffers(self.settings.slots)
        me = asyncio.current_task()
        try:
            try:
                hello = await asyncio.wait_for(recv_header(loop, sock), self.settings.handshake_timeout_s)
            except asyncio.TimeoutError:
                raise FrameError("no hello in time") from None
            if hello["op"] != "hello":
                raise FrameError("expected hello")
            if hello.get("shm") and same_host(_peer_address(sock)):
                try:
                    ring = shm_ring.ShmView(hello["shm"], hello["nonce"], hello["slots"], hello["slot_bytes"])
                except (OSError, ValueError, TypeError, KeyError) as e:
                    log.debug("no shared memory with this sender: %s", e)
            await send_all(loop, sock, header(op="hello", shm=ring is not None))
            while True:
                h = await recv_header(loop, sock)
                if h["op"] != "kv":
                    raise FrameError(f"unexpected {h['op']!r}")
                nbytes, slot = h.get("nbytes"), h.get("slot", -1)
                if not isinstance(nbytes, int) or not 0 < nbytes <= self.settings.max_frame_bytes:
                    raise FrameError(f"frame of {nbytes!r} bytes")
                if not isinstance(slot, int):
                    raise FrameError("slot is not an int")
                if slot < 0 and not self.registry.authorized(h.get("t"), h.get("tok")):
                    await discard(loop, sock, nbytes)  # a stranger's (or a late) frame: no allocation
                    payload = memoryview(b"")
                elif slot < 0:
                    self._unproven.pop(me, None)  # type: ignore[arg-type]
                    buf = buffers.take(nbytes)
                    payload = memoryview(buf)[:nbytes]
                    await recv_into(loop, sock, payload)
                elif ring is not None:
                    if self.registry.authorized(h.get("t"), h.get("tok")):
                        self._unproven.pop(me, None)  # type: ignore[arg-type]
                    payload = ring.slot(slot, nbytes)
                    self.shm_frames += 1
                else:
                    raise FrameError("a shared-memory frame without a ring")
                self.frames += 1
                task = asyncio.ensure_future(self._frame(h, payload, sock, lock))
                frames.add(task)
                task.add_done_callback(frames.discard)
                if slot < 0 and len(payload):
                    # Acked means written into the KV cache: nothing holds the buffer after the task.
                    task.add_done_callback(lambda _, buf=buf: buffers.give(buf))
        except (FrameError, OSError, ValueError, KeyError) as e:
            log.info("direct KV connection closed: %s", e)
        finally:
            # A frame being written finishes (its blocks are the engine's now); its ack may not get out.
            await asyncio.gather(*frames, return_exceptions=True)
            sock.close()
            if ring is not None:
                ring.close()

    async def _frame(self, h: dict, payload: memoryview, sock: socket.socket, lock: asyncio.Lock) -> None:
        tid, seq = h.get("t"), h.get("seq")
        carrier = h.get("tp")  # the sender's trace context: the frame joins the request's trace
        parent = propagate.extract(carrier) if isinstance(carrier, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in carrier.items()) else None
        with _tracer.start_as_current_span("kv.transfer.receive", context=parent, attributes={
                "kvmesh.transfer_id": str(tid), "kvmesh.kv.chunk": seq if isinstance(seq, int) else -1,
                "kvmesh.kv.path": "shm" if h.get("slot", -1) >= 0 else "tcp"}):
            error = await self._place(h, payload)
        async with lock:
            try:
                await send_all(asyncio.get_running_loop(), sock, header(op="ack", t=tid, seq=seq, ok=error is None,
                                                                        err=error))
            except OSError:
                pass

    async def _place(self, h: dict, payload: memoryview) -> str | None:
        try:
            tid, seq, total = str(h["t"]), int(h["seq"]), int(h["total"])
            l0, l1, b0, b1 = (int(h[k]) for k in ("l0", "l1", "b0", "b1"))
            token, shape = h["tok"], list(h["shape"])
            if not isinstance(token, bytes) or not (0 <= l0 < l1 and 0 <= b0 < b1) or shape[:2] != [l1 - l0, b1 - b0]:
                raise ValueError("ranges or shape out of order")
        except (KeyError, TypeError, ValueError) as e:
            return f"bad frame header: {e}"
        inc, error = self.registry.check(tid, seq, total, b1, token=token)
        if inc is not None and h.get("slot", -1) < 0 and digest(payload) != h.get("xxh"):
            inc, error = None, f"checksum mismatch on chunk {seq}"
        if inc is not None:
            try:
                blocks = KVBlocks(*kv_views(payload, h.get("dtype"), shape), first_block=b0, first_layer=l0)
            except (FrameError, ValueError) as e:
                inc, error = None, str(e)
        if inc is None:
            if error not in ("unknown transfer", "wrong transfer token"):  # strangers cannot end transfers
                self.registry.refuse(tid, error or "refused")
            return error
        return await self.registry.accept(tid, inc, seq, total, blocks)


# --------------------------------------------------------------------------- sending (prefill side)


def _peer_address(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return ""


def _copy_into(dst: memoryview, src: torch.Tensor) -> None:
    """One plain memcpy (strided if it must) of a CPU tensor's bytes into shared memory. Not torch's
    copy_: that one fans out over the intra-op threads, which on a loaded host fight the receiver (and
    the engine) for cores; one core copying measured faster end to end (2 cores, 2 processes: ~7 ms vs
    ~11 ms for 33.6 MB)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8).reshape(*src.shape[:-1], -1), src.view(torch.uint8).numpy())


@dataclass
class _Conn:
    sock: socket.socket
    ring: shm_ring.ShmRing | None
    slots: asyncio.Queue  # free slot numbers (ring) or window tokens (inline)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    acks: dict[tuple[str, int], asyncio.Future] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    broken: str | None = None

    def close(self, reason: str) -> None:
        """Marks the connection broken and fails what waits on it. The socket is only shut down here:
        its reader task closes it, because closing a socket asyncio still watches can hand its file
        descriptor number, and the stale watcher, to the next connection."""
        self.broken = self.broken or reason
        for fut in self.acks.values():
            if not fut.done():
                fut.set_exception(TransferError(f"direct KV connection lost: {self.broken}"))
        self.acks.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def release(self) -> None:
        self.sock.close()
        if self.ring is not None:
            self.ring.close()


class DirectSender:
    def __init__(self, settings: DirectSettings = DirectSettings(), connect_timeout_s: float = 2.0) -> None:
        self.settings = settings
        self.connect_timeout_s = connect_timeout_s
        self._conns: dict[str, _Conn] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    def uses_shared_memory(self, endpoint: str) -> bool:
        conn = self._conns.get(endpoint)
        return conn is not None and conn.ring is not None

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close("sender closed")
            if conn.reader is not None:
                conn.reader.cancel()
        await asyncio.gather(*(c.reader for c in conns if c.reader is not None), return_exceptions=True)

    async def _conn(self, endpoint: str) -> _Conn:
        conn = self._conns.get(endpoint)
        if conn is not None and conn.broken is None:
            return conn
        pending = self._connecting.get(endpoint)  # one handshake per endpoint, however many transfers wait
        if pending is None:
            pending = self._connecting[endpoint] = asyncio.ensure_future(self._open(endpoint))
            pending.add_done_callback(lambda _: self._connecting.pop(endpoint, None))
        return await asyncio.shield(pending)

    async def _open(self, endpoint: str) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port = parse_endpoint(endpoint)
        s = self.settings
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, addr), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise DirectUnavailable(f"cannot reach {endpoint}: {str(e) or type(e).__name__}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ring = None
        if s.shared_memory and shm_ring.available() and same_host(addr[0]):
            try:
                ring = shm_ring.ShmRing(s.slots, s.frame_bytes)
            except OSError as e:
                log.info("no shared-memory ring: %s", e)
        try:
            hello = {"op": "hello"}
            if ring is not None:
                hello |= {"shm": ring.name, "nonce": ring.nonce, "slots": ring.slots, "slot_bytes": ring.slot_bytes}
            await send_all(loop, sock, header(**hello))
            answer = await asyncio.wait_for(recv_header(loop, sock), self.connect_timeout_s)
        except (OSError, FrameError, asyncio.TimeoutError) as e:
            sock.close()
            if ring is not None:
                ring.close()
            raise DirectUnavailable(f"no handshake with {endpoint}: {str(e) or type(e).__name__}") from None
        if ring is not None:
            ring.unlink()  # mapped on both sides now (or never will be): the name is no longer needed
            if not answer.get("shm"):
                ring.close()
                ring = None
        slots: asyncio.Queue = asyncio.Queue()
        for i in range(s.slots):
            slots.put_nowait(i)
        conn = _Conn(sock, ring, slots)
        conn.reader = asyncio.ensure_future(self._read_acks(conn))
        self._conns[endpoint] = conn
        return conn

    async def _read_acks(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                h = await recv_header(loop, conn.sock)
                fut = conn.acks.pop((h.get("t"), h.get("seq")), None)
                if fut is not None and not fut.done():
                    fut.set_result(h)
        except (FrameError, OSError) as e:
            conn.close(str(e))
        except asyncio.CancelledError:
            conn.close("cancelled")
            raise
        finally:
            conn.release()

    def num_frames(self, blocks: KVBlocks) -> int:
        return len(self._plan(blocks))

    def _plan(self, blocks: KVBlocks) -> list[tuple[int, int, int, int]]:
        per_block_layer = blocks.bytes_per_block // blocks.num_layers
        return plan_chunks(blocks.num_layers, blocks.num_blocks, per_block_layer, self.settings.frame_bytes, headroom=0)

    async def connect(self, endpoint: str) -> None:
        """Opens (or reuses) the connection to endpoint; DirectUnavailable when it cannot be reached."""
        await self._conn(endpoint)

    async def send(self, endpoint: str, token: bytes, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   first_seq: int = 0, final: bool = True) -> int:
        """Push blocks [first_block, end_block) as frames first_seq, first_seq + 1, ...;
        returns payload bytes sent. final=False: a piece of a transfer whose size is not known yet (its
        frames say total 0; the final piece's frames carry the transfer's frame count)."""
        conn = await self._conn(endpoint)
        loop = asyncio.get_running_loop()
        n, first_block, k, v = blocks.num_blocks, blocks.first_block, blocks.k, blocks.v
        chunks = self._plan(blocks)
        total = first_seq + len(chunks) if final else 0
        deadline = time.monotonic() + deadline_s
        dtype = str(k.dtype).removeprefix("torch.")
        sent = 0
        span = _tracer.start_span("kv.transfer.send", attributes={
            "kvmesh.transfer_id": transfer_id, "kvmesh.kv.blocks": n, "kvmesh.kv.chunks": len(chunks),
            "kvmesh.kv.path": "shm" if conn.ring is not None else "tcp"})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))

        async def one(seq: int, l0: int, l1: int, b0: int, b1: int) -> None:
            nonlocal sent
            kk, vv = k[l0:l1, b0:b1], v[l0:l1, b0:b1]
            half = kk.numel() * kk.element_size()
            try:
                slot = await asyncio.wait_for(conn.slots.get(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise TransferError(f"transfer {transfer_id} passed its deadline") from None
            reusable = True  # False once the frame is out and unanswered: the receiver may still read it
            try:
                if conn.ring is not None:
                    view = conn.ring.slot(slot)
                    _copy_into(view[:half], kk)
                    _copy_into(view[half:2 * half], vv)
                    parts: tuple[memoryview, ...] = ()
                    # No checksum: memory is not a lossy channel, and two more passes over every byte
                    # would cost about half of this path's time. TCP frames are checked.
                    xxh, frame_slot = None, slot
                else:
                    parts = (as_bytes(kk.contiguous()), as_bytes(vv.contiguous()))
                    xxh, frame_slot = digest(*parts), -1
                if conn.broken is not None:
                    raise TransferError(f"direct KV connection lost: {conn.broken}")
                fut = conn.acks[(transfer_id, seq)] = loop.create_future()
                hdr = header(op="kv", t=transfer_id, tok=token, seq=seq, total=total, l0=l0, l1=l1,
                             b0=first_block + b0, b1=first_block + b1, dtype=dtype, shape=list(kk.shape),
                             nbytes=2 * half, slot=frame_slot, xxh=xxh, tp=carrier)
                async with conn.lock:
                    reusable = False
                    try:
                        await send_all(loop, conn.sock, hdr, *parts)
                    except OSError as e:
                        conn.close(str(e))
                        raise TransferError(f"direct KV connection lost: {e}") from None
                ack = await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.001))
                reusable = True
            except asyncio.TimeoutError:
                # The receiver may read the slot later: this connection and its ring are not reused.
                conn.close("a frame went unanswered")
                raise TransferError(f"transfer {transfer_id} passed its deadline") from None
            finally:
                conn.acks.pop((transfer_id, seq), None)
                if reusable:
                    conn.slots.put_nowait(slot)
            if not ack.get("ok"):
                raise TransferError(f"decode refused chunk {seq} of {transfer_id}: {ack.get('err')}")
            sent += 2 * half

        tasks = [asyncio.ensure_future(one(first_seq + i, *c)) for i, c in enumerate(chunks)]
        try:
            await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            span.set_status(trace.StatusCode.ERROR, str(e))
            raise
        finally:
            span.set_attribute("kvmesh.kv.bytes", sent)
            span.end()
        return sent
