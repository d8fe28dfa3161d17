"""Chunked uploads hold the bytes they sent, not the size they announced: a sender that announces large
uploads and never sends them must not hold the receiver's upload budget and shut out a real upload (a real
nats-server, the real bus server)."""
from __future__ import annotations

import asyncio

from shared import bus, wire
from shared import protocol as p
from shared.bus import headers as H
from tests.nats_fixtures import nats_server, wait_responders  # noqa: F401
from tests.test_bus import ENCODE, echo_encode

LIMITS = bus.BusLimits(max_message_bytes=4 << 20, max_pending_bytes=8 << 20, reassembly_timeout=20)


def test_announced_but_unsent_uploads_do_not_hold_the_budget(nats_server) -> None:  # noqa: ANN001, F811
    async def go() -> None:
        server_nc, client = await bus.connect(nats_server), await bus.connect(nats_server)
        served = await bus.serve(server_nc, ENCODE, "q", echo_encode, p.EncodeRequest, limits=LIMITS)
        await server_nc.flush()
        await wait_responders(client, ENCODE)  # a flushed subscription can be unknown to another connection a moment
        try:
            for i in range(3):  # 12 MiB announced against an 8 MiB budget; 3 bytes each sent
                hdrs = {H.CHUNK: "0/2", H.MSG_ID: f"hog{i}", H.SIZE: str(4 << 20), H.UPLOAD: "1"}
                ack = await client.request(ENCODE, b"abc", timeout=5, headers=hdrs)
                assert H.UPLOAD in (ack.headers or {}), "the handshake was refused"
            # A real upload of 3 MiB (chunked: max_payload is 1 MiB) goes through meanwhile.
            reply = await bus.request(client, ENCODE, p.EncodeRequest(prompt="x" * (3 << 20)), timeout=15)
            assert reply.token_ids == [3 << 20]
        finally:
            await served.stop()
            await server_nc.close()
            await client.close()

    asyncio.run(go())
