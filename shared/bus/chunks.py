"""Chunk framing: logical messages larger than the server's max_payload.

A message that does not fit (payload + headers > nc.max_payload; the server counts both and
closes the connection on a violation) is cut into n chunks, each carrying
`Kvmesh-Chunk: i/n`, `Kvmesh-Msg-Id: <id>`, `Kvmesh-Size: <total bytes>` plus the logical
message's own headers (trace context, stream sequence).

Two ways to deliver the chunks, because a queue group could hand each chunk to a different
member:
  * direct: every chunk goes to the same subject. Only for subjects with a single consumer of
    each message: reply inboxes and fan-out subscribers (no queue group). NATS keeps one
    publisher's messages on one subject in order, so chunks arrive in order.
  * upload (requests to possibly queue-grouped service subjects): chunk 0 is sent as a NATS
    request with `Kvmesh-Upload: 1` and the real reply subject in `Kvmesh-Reply`; the member
    that received it answers with `Kvmesh-Upload: <private inbox>`, and chunks 1..n-1 go
    there. The handshake costs one round trip, only for oversized requests, and it keeps NATS's
    immediate "no responders" answer. Both directions are replies, which is all a locked-down bus
    (shared/bus/roles.py, `allow_responses`) lets a process publish to another's inbox: the
    answer names the private inbox as its reply subject, and chunks 1..n-1 carry the real reply
    subject as theirs, so the member may answer it.

A responder takes a reply subject only from a message's NATS reply, never from the `Kvmesh-Reply`
header (which only says what the sender will use): a header can name any inbox this process was
once allowed to answer, another requester's pending one included. A one-chunk upload (never sent
by send_upload: a message that fits is a plain request) is refused.
"""
from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.bus import headers as H
from shared.bus.errors import BusError, BusTimeout, ChunkError, NoRespondersError, RemoteError
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.sender import sender_of

_SPEC = re.compile(r"(\d{1,9})/(\d{1,9})")
_SIZE = re.compile(r"\d{1,12}")
_MIN_ROOM = 1024  # if headers leave less than this per chunk, something is wrong with them


@dataclass(frozen=True)
class Envelope:
    """One logical (reassembled) message."""

    subject: str
    reply: str
    headers: dict[str, str]
    data: bytes


def frames(max_payload: int, data: bytes, headers: dict[str, str]) -> list[tuple[bytes, dict[str, str]]]:
    """(payload, headers) per NATS message; a single frame when the message fits."""
    if len(data) + H.header_bytes(headers) <= max_payload:
        return [(data, headers)]
    base = {**headers, H.MSG_ID: uuid.uuid4().hex, H.SIZE: str(len(data))}
    room = max_payload - H.header_bytes({**base, H.CHUNK: "999999999/999999999"})
    if room < _MIN_ROOM:
        raise BusError(f"headers take {max_payload - room} of max_payload {max_payload} bytes")
    n = math.ceil(len(data) / room)
    view = memoryview(data)
    return [(bytes(view[i * room : (i + 1) * room]), {**base, H.CHUNK: f"{i}/{n}"}) for i in range(n)]


async def send_direct(nc: Client, subject: str, data: bytes, headers: dict[str, str], reply: str = "") -> None:
    """Publishes to a single-consumer subject (inbox, fan-out), chunked if needed."""
    sender = sender_of(nc)
    if sender:
        headers = {**headers, H.FROM: sender}
    for payload, hdrs in frames(nc.max_payload, data, headers):
        await nc.publish(subject, payload, reply=reply, headers=hdrs or None)


async def send_upload(nc: Client, subject: str, data: bytes, headers: dict[str, str], reply: str, timeout: float) -> None:
    """Publishes a request to a service subject; oversized ones go through the upload handshake."""
    if len(data) + H.header_bytes(headers) <= nc.max_payload:
        await nc.publish(subject, data, reply=reply, headers=headers or None)
        return
    upload_headers = {**headers, H.UPLOAD: "1"}
    if reply:
        upload_headers[H.REPLY] = reply
    parts = frames(nc.max_payload, data, upload_headers)
    try:
        ack = await nc.request(subject, parts[0][0], timeout=timeout, headers=parts[0][1])
    except nats.errors.NoRespondersError:
        raise NoRespondersError(subject) from None
    except nats.errors.TimeoutError:
        raise BusTimeout(subject, timeout, "upload handshake") from None
    target = ack.reply or (ack.headers or {}).get(H.UPLOAD)
    if not target or H.UPLOAD not in (ack.headers or {}):
        raise _refusal(subject, ack)
    for payload, hdrs in parts[1:]:
        await nc.publish(target, payload, reply=reply, headers=hdrs)


class UploadBudget:
    """Bytes of the chunked uploads one connection is receiving, all subjects together: each upload has
    its own bound (max_message_bytes), and this one bounds their sum (max_pending_bytes), so many
    concurrent uploads cannot exhaust the process's memory, and each sender's share (sender_bytes), so one
    sender's uploads, sent slowly or never finished, cannot take the whole budget from the others."""

    def __init__(self, limit: int, sender_limit: int | None = None) -> None:
        self.limit = limit
        self.sender_limit = limit if sender_limit is None else sender_limit
        self.used = 0
        self.by_sender: dict[str, int] = {}

    def reserve(self, nbytes: int, sender: str = "") -> None:
        held = self.by_sender.get(sender, 0)
        if held + nbytes > self.sender_limit:
            raise ChunkError(f"this sender's uploads being received would hold {held + nbytes} bytes, over the "
                             f"{self.sender_limit}-byte limit a sender has; try again later")
        if self.used + nbytes > self.limit:
            raise ChunkError(f"uploads being received would hold {self.used + nbytes} bytes, over the "
                             f"{self.limit}-byte limit; try again later")
        self.used += nbytes
        self.by_sender[sender] = held + nbytes

    def release(self, nbytes: int, sender: str = "") -> None:
        self.used -= nbytes
        left = self.by_sender.get(sender, 0) - nbytes
        if left > 0:
            self.by_sender[sender] = left
        else:
            self.by_sender.pop(sender, None)


def upload_budget(nc: Client, limits: BusLimits) -> UploadBudget:
    """The connection's budget (made on first use; a process normally has one connection)."""
    budget = getattr(nc, "_kvmesh_upload_budget", None)
    if budget is None:
        budget = UploadBudget(limits.max_pending_bytes, limits.sender_bytes)
        nc._kvmesh_upload_budget = budget  # type: ignore[attr-defined]
    return budget


def upload_sender(reply: str) -> str:
    """Who an upload is from: its reply subject's inbox (`_INBOX.<token>.…`). On a locked-down bus only the
    identity whose inbox it is receives the handshake answer, so only it can send the upload's other chunks
    (shared/bus/roles.py); on an open bus the token is the sending connection's own."""
    parts = reply.split(".")
    return ".".join(parts[:2])


async def receive_upload(nc: Client, first: Msg, limits: BusLimits = DEFAULT_LIMITS) -> Envelope:
    """The responder side of the handshake: collects chunks 1..n-1 on a private inbox."""
    if not first.reply:
        raise ChunkError("upload without a reply subject for the handshake")
    assembler = Reassembler(limits)
    if assembler.feed(first) is not None:
        raise ChunkError("a one-chunk upload: a message that fits is sent as a plain request")
    # The budget holds the bytes received, not the size announced: an upload announced big and never sent
    # holds only what it sent (the announced size is still bounded by max_message_bytes in feed()).
    budget = upload_budget(nc, limits)
    held = _Held(budget, upload_sender(first.reply))
    held.add(len(first.data))
    try:
        return await _collect(nc, first, assembler, limits, held)
    finally:
        held.release()


class _Held:
    """Bytes of one upload held against the connection's budget and its sender's share."""

    def __init__(self, budget: UploadBudget, sender: str = "") -> None:
        self.budget, self.sender, self.n = budget, sender, 0

    def add(self, nbytes: int) -> None:
        self.budget.reserve(nbytes, self.sender)
        self.n += nbytes

    def release(self) -> None:
        self.budget.release(self.n, self.sender)
        self.n = 0


class UploadFailed(ChunkError):
    """An upload that broke after chunks came in: `reply` is the NATS reply they carried (the requester's
    real reply subject, which this process may answer)."""

    def __init__(self, message: str, reply: str) -> None:
        super().__init__(message)
        self.reply = reply


async def _collect(nc: Client, first: Msg, assembler: Reassembler, limits: BusLimits, held: _Held) -> Envelope:
    sub = await nc.subscribe(nc.new_inbox())
    try:
        await nc.publish(first.reply, b"", reply=sub.subject, headers={H.UPLOAD: sub.subject})
        deadline = time.monotonic() + limits.reassembly_timeout
        reply = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UploadFailed(f"upload on {first.subject!r} not complete within {limits.reassembly_timeout:g}s",
                                   reply)
            try:
                msg = await sub.next_msg(timeout=remaining)
            except nats.errors.TimeoutError:
                continue
            reply = msg.reply or reply
            try:
                held.add(len(msg.data))
                env = assembler.feed(msg)
            except ChunkError as e:
                raise UploadFailed(str(e), reply) from None
            if env is not None:  # the reply subject the chunks came with is the one this process may answer
                return Envelope(first.subject, msg.reply, env.headers, env.data)
    finally:
        await unsubscribe_quietly(sub)


@dataclass
class _Partial:
    first: Msg
    n: int
    size: int
    started: float
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


class Reassembler:
    """Joins in-order chunks back into Envelopes; unchunked messages pass straight through.

    Not thread safe; feed it from one task (a subscription's callback or reader loop).
    """

    def __init__(self, limits: BusLimits = DEFAULT_LIMITS, clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._partial: dict[str, _Partial] = {}

    @property
    def pending_bytes(self) -> int:
        """Bytes received of partial messages (not the sizes they announce: an announced size costs nothing
        until it is sent)."""
        return sum(p.received for p in self._partial.values())

    def feed(self, msg: Msg) -> Envelope | None:
        hdrs = msg.headers or {}
        spec = hdrs.get(H.CHUNK)
        if spec is None:
            return Envelope(msg.subject, msg.reply, hdrs, msg.data)
        self._expire()
        msg_id = hdrs.get(H.MSG_ID, "")
        try:
            return self._feed_chunk(msg, spec, msg_id, hdrs.get(H.SIZE, ""))
        except ChunkError:
            self._partial.pop(msg_id, None)
            raise

    def _feed_chunk(self, msg: Msg, spec: str, msg_id: str, size_text: str) -> Envelope | None:
        m = _SPEC.fullmatch(spec)
        if not m or not msg_id or not _SIZE.fullmatch(size_text):
            raise ChunkError(f"bad chunk headers {H.CHUNK}={spec!r} {H.MSG_ID}={msg_id!r} {H.SIZE}={size_text!r}")
        i, n, size = int(m[1]), int(m[2]), int(size_text)
        if not (i < n and n <= max(size, 1)):
            raise ChunkError(f"chunk {i}/{n} of a {size}-byte message is impossible")
        if size > self._limits.max_message_bytes:
            raise ChunkError(f"message of {size} bytes exceeds the {self._limits.max_message_bytes}-byte limit")
        p = self._partial.get(msg_id)
        if p is None:
            if i != 0:
                raise ChunkError(f"chunk {i}/{n} of unknown message {msg_id} (lost chunks or timed out)")
            p = _Partial(msg, n, size, self._clock())
        elif (n, size) != (p.n, p.size) or i != len(p.parts):
            raise ChunkError(f"chunk {i}/{n} out of order for message {msg_id} (expected {len(p.parts)}/{p.n})")
        if self.pending_bytes + len(msg.data) > self._limits.max_pending_bytes:
            raise ChunkError("too many bytes in partially received messages")
        self._partial[msg_id] = p
        p.parts.append(msg.data)
        p.received += len(msg.data)
        if p.received > p.size or (i == n - 1 and p.received != p.size):
            raise ChunkError(f"message {msg_id}: received {p.received} bytes, announced {p.size}")
        if i < n - 1:
            return None
        del self._partial[msg_id]
        first_headers = p.first.headers or {}
        logical = {k: v for k, v in first_headers.items() if k not in H.FRAMING}
        # An upload's reply is its chunks' NATS reply (receive_upload); the header is never trusted.
        reply = "" if H.UPLOAD in first_headers else p.first.reply
        return Envelope(p.first.subject, reply, logical, b"".join(p.parts))

    def _expire(self) -> None:
        cutoff = self._clock() - self._limits.reassembly_timeout
        for msg_id in [k for k, p in self._partial.items() if p.started < cutoff]:
            del self._partial[msg_id]


def _refusal(subject: str, ack: Msg) -> BusError:
    from shared import wire
    from shared.bus.error_reply import ErrorReply

    try:
        err = wire.decode(ack.data, ErrorReply)
    except wire.WireError:
        return BusError(f"{subject!r} answered the upload handshake without an upload inbox")
    return RemoteError(err.code, err.message, subject)


async def unsubscribe_quietly(sub: object) -> None:
    try:
        await sub.unsubscribe()  # type: ignore[attr-defined]
    except nats.errors.Error:  # closed or draining connection: nothing left to release
        pass
