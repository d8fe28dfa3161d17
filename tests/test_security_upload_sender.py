"""Chunked uploads are budgeted per sender, by the bytes each sent: on a locked-down bus (a real nats-server with
the role users), a prefill identity that keeps uploads to the kvstore's subject open (chunks sent, never the
last) holds at most its own share of the receiver's upload budget, so a decode identity's real upload still goes
through; the hog's own next chunk beyond its share is refused. Direct (fan-out) reassembly holds the bytes
received, not the sizes announced."""
from __future__ import annotations

import asyncio
import os

import nats
import pytest

from shared import bus, subjects
from shared import protocol as p
from shared.bus import headers as H
from shared.bus.chunks import Reassembler, UploadBudget, upload_sender
from shared.bus.errors import ChunkError
from shared.launcher.local_nats import LocalNats, role_passwords
from tests.nats_fixtures import locked_nats, wait_responders

MiB = 1 << 20
LIMITS = bus.BusLimits(max_message_bytes=4 * MiB, max_pending_bytes=8 * MiB, max_sender_bytes=4 * MiB,
                       reassembly_timeout=20)
PIECE = 512 << 10  # a chunk that fits the server's 1 MiB max_payload with its headers


@pytest.fixture
def server(tmp_path):  # noqa: ANN001, ANN201
    with locked_nats(tmp_path, role_passwords()) as srv:
        yield srv


async def _as(srv: LocalNats, role: str) -> nats.NATS:
    return await bus.connect(srv.url, user=role, password=srv.passwords[role], inbox_prefix=f"_INBOX.{role}",
                             allow_reconnect=False, max_reconnect_attempts=0)


async def _echo(req: p.EncodeRequest, ctx: bus.RequestContext) -> p.EncodeReply:  # noqa: ARG001
    return p.EncodeReply(token_ids=[len(req.prompt)])


async def _hold_open(nc: nats.NATS, msg_id: str, pieces: int) -> int:
    """Starts a 4 MiB upload to the kvstore's subject and sends `pieces` chunks of it, never the last: the
    chunks the receiver took (it refuses the rest with an error reply)."""
    n = (4 * MiB) // PIECE
    hdrs = {H.CHUNK: f"0/{n}", H.MSG_ID: msg_id, H.SIZE: str(4 * MiB), H.UPLOAD: "1"}
    ack = await nc.request(subjects.KVSTORE_PUT, os.urandom(PIECE), timeout=5, headers=hdrs)
    target = (ack.headers or {}).get(H.UPLOAD)
    assert target, "the handshake was refused"
    inbox = nc.new_inbox()
    refused = asyncio.Event()

    async def on_reply(msg) -> None:  # noqa: ANN001
        refused.set()
    sub = await nc.subscribe(inbox, cb=on_reply)
    sent = 1
    for i in range(1, pieces):
        if refused.is_set():
            break
        await nc.publish(target, os.urandom(PIECE), reply=inbox,
                         headers={H.CHUNK: f"{i}/{n}", H.MSG_ID: msg_id, H.SIZE: str(4 * MiB)})
        await nc.flush()
        await asyncio.sleep(0.05)
        sent += 1
    await asyncio.sleep(0.3)
    await sub.unsubscribe()
    return sent - (1 if refused.is_set() else 0)


def test_one_senders_open_uploads_do_not_shut_another_sender_out(server) -> None:  # noqa: ANN001
    async def go() -> None:
        kvstore, hog, decode = await _as(server, "kvstore"), await _as(server, "prefill"), await _as(server, "decode")
        served = await bus.serve(kvstore, subjects.KVSTORE_PUT, subjects.QUEUE_KVSTORE, _echo, p.EncodeRequest,
                                 limits=LIMITS)
        await kvstore.flush()
        await wait_responders(hog, subjects.KVSTORE_PUT)
        await wait_responders(decode, subjects.KVSTORE_PUT)
        try:
            # Two uploads of 3 MiB each, kept open: 6 MiB of an 8 MiB budget, unless a sender's share stops them.
            await _hold_open(hog, "hog-1", 6)
            await _hold_open(hog, "hog-2", 6)
            budget = kvstore._kvmesh_upload_budget  # noqa: SLF001
            assert budget.by_sender.get("_INBOX.prefill", 0) <= LIMITS.max_sender_bytes
            # Another identity's real upload of 3 MiB (chunked) goes through meanwhile.
            reply = await bus.request(decode, subjects.KVSTORE_PUT, p.EncodeRequest(prompt="x" * (3 * MiB)),
                                      timeout=15)
            assert reply.token_ids == [3 * MiB]
        finally:
            await served.stop()
            for c in (kvstore, hog, decode):
                await c.close()

    asyncio.run(go())


def test_budget_shares_and_direct_reassembly_count_bytes_received() -> None:
    budget = UploadBudget(8 * MiB, 4 * MiB)
    budget.reserve(4 * MiB, "_INBOX.prefill")
    with pytest.raises(ChunkError, match="a sender has"):
        budget.reserve(1, "_INBOX.prefill")
    budget.reserve(4 * MiB, "_INBOX.decode")
    budget.release(4 * MiB, "_INBOX.prefill")
    assert budget.used == 4 * MiB and budget.by_sender == {"_INBOX.decode": 4 * MiB}
    assert upload_sender("_INBOX.prefill-0.abc.1") == "_INBOX.prefill-0"

    class Msg:  # a direct chunk as nats-py hands it over
        def __init__(self, i: int, n: int, size: int, msg_id: str) -> None:
            self.subject, self.reply, self.data = "kvmesh.decode.kv.push.d0", "", b"x" * 1024
            self.headers = {H.CHUNK: f"{i}/{n}", H.MSG_ID: msg_id, H.SIZE: str(size)}

    r = Reassembler(LIMITS)
    for k in range(20):  # 80 MiB announced against 8 MiB: each holds the 1 KiB it sent
        assert r.feed(Msg(0, 4, 4 * MiB, f"m{k}")) is None
    assert r.pending_bytes == 20 * 1024
