"""Hostile messages for any served subject: the service must answer bad_request and stay up."""
from __future__ import annotations

import pickle

import msgpack
from nats.aio.client import Client

from shared import protocol as p
from shared import wire
from shared.bus import headers as H


def hostile_bodies(kind: str, valid: wire.Message) -> list[bytes]:
    """Pickle, a msgpack extension type, truncated msgpack, and a wrong schema, for message `kind`."""
    encoded = wire.encode(valid)
    return [
        pickle.dumps({"kind": kind, "version": 1}),
        msgpack.packb({"kind": kind, "version": 1, "x": msgpack.ExtType(1, b"boom")}),
        encoded[: len(encoded) // 2],
        msgpack.packb({"kind": kind, "version": 1, "prompt": 5, "sequences": "nope"}),
        msgpack.packb([kind, 1]),
    ]


async def assert_survives(nc: Client, subject: str, bodies: list[bytes]) -> None:
    """Each body gets a bad_request answer; a never-finished chunked message is dropped silently."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    for body in bodies:
        await nc.publish(subject, body, reply=inbox)
        await nc.publish(subject, body)  # and without a reply subject: nothing to answer, nothing to crash
    await nc.publish(subject, b"\x81", reply=inbox, headers={H.CHUNK: "0/2", H.MSG_ID: "m1", H.SIZE: "2"})
    errors = [wire.decode((await sub.next_msg(timeout=5)).data, p.ErrorReply) for _ in bodies]
    assert {e.code for e in errors} == {"bad_request"}
    assert any("extension" in e.message for e in errors)
    await sub.unsubscribe()
