"""Reply steering: a process holding another credential makes a service answer into a victim's pending
inbox. Two ways, both attacked here:

  * the `Kvmesh-Reply` header of an upload (one chunk, or one that breaks): nats-server lets the service
    publish to any inbox it was once allowed to answer, so the header could aim its answer at another
    requester's pending inbox. Attacked on a real nats-server with `kvmesh up`'s real per-process users
    and permissions: the victim's inbox must receive nothing but its own answer.
  * a NATS reply subject naming the victim's inbox (which the bus cannot refuse): a real decode worker must
    take a prefill reply only when its request_id and transfer_id are its own. A real prefill worker whose
    answers arrive as another request's (an attacker-chosen first token) must not set the victim's first
    token: the decode worker computes the prompt itself and its output matches transformers.
"""
from __future__ import annotations

import asyncio

import nats
import pytest

from services.prefill.service import PrefillService
from shared import bus, subjects, wire
from shared.bus import headers as H
from shared.bus.error_reply import ErrorReply
from shared.launcher.local_nats import LocalNats, identity_passwords
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import decode_service, generate, prefill_service, running, wait_idle
from tests.nats_fixtures import locked_nats, nats_server, wait_responders  # noqa: F401


@pytest.fixture
def locked(tmp_path):  # noqa: ANN001, ANN201
    with locked_nats(tmp_path, identity_passwords(["decode-0", "decode-1", "prefill-0"])) as srv:
        yield srv


async def _as(srv: LocalNats, user: str) -> nats.NATS:
    return await bus.connect(srv.url, **{"user": user, "password": srv.passwords[user],
                                         "inbox_prefix": f"_INBOX.{user}"})


def _request(rid: str) -> RemotePrefillRequest:
    return RemotePrefillRequest(request_id=rid, transfer_id=f"t-{rid}", prompt_token_ids=[1, 2, 3],
                                num_cached_tokens=0, decode_worker_id="decode-1", num_dest_blocks=1, block_size=16)


def test_an_upload_header_cannot_steer_an_answer_into_another_requesters_inbox(locked: LocalNats) -> None:
    async def go() -> None:
        release = asyncio.Event()

        async def prefill(req: RemotePrefillRequest, ctx: bus.RequestContext) -> RemotePrefillReply:
            if req.request_id == "victim":
                await release.wait()  # the victim's answer is pending: its inbox may be answered
            return RemotePrefillReply(request_id=req.request_id, transfer_id=req.transfer_id, first_token_id=666)

        server_nc, victim, attacker = [await _as(locked, u) for u in ("prefill-0", "decode-1", "decode-0")]
        served = await bus.serve(server_nc, subjects.PREFILL_PREFILL, subjects.QUEUE_PREFILL, prefill,
                                 RemotePrefillRequest)
        # The server has the subscription before the victim asks: otherwise, on a busy machine, nats-server
        # may answer the victim's inbox with an empty no-responders status first (a flush of the server's
        # connection was not enough).
        await server_nc.flush()
        await wait_responders(victim, subjects.PREFILL_PREFILL)
        await wait_responders(attacker, subjects.PREFILL_PREFILL)
        try:
            inbox = victim.new_inbox()
            got = await victim.subscribe(inbox)
            await victim.publish(subjects.PREFILL_PREFILL, wire.encode(_request("victim")), reply=inbox)
            await victim.flush()
            await asyncio.sleep(0.2)
            # A one-chunk "upload" naming the victim's inbox in its header.
            data = wire.encode(_request("attacker"))
            one = {H.CHUNK: "0/1", H.MSG_ID: "a", H.SIZE: str(len(data)), H.UPLOAD: "1", H.REPLY: inbox}
            own = await attacker.subscribe(attacker.new_inbox())
            await attacker.publish(subjects.PREFILL_PREFILL, data, reply=own.subject, headers=one)
            # An upload that breaks after its handshake (chunk 1 claims more bytes than announced).
            two = {H.CHUNK: "0/2", H.MSG_ID: "b", H.SIZE: str(len(data)), H.UPLOAD: "1", H.REPLY: inbox}
            ack = await attacker.request(subjects.PREFILL_PREFILL, data[:4], timeout=5, headers=two)
            await attacker.publish(ack.reply, data * 2, reply=own.subject, headers={**two, H.CHUNK: "1/2"})
            await attacker.flush()
            # The attacker's own inbox is answered (the refusals); the victim's receives nothing.
            refused = [wire.decode((await own.next_msg(timeout=5)).data, ErrorReply) for _ in range(2)]
            assert {r.code for r in refused} == {"bad_request"}, refused
            with pytest.raises(nats.errors.TimeoutError):
                msg = await got.next_msg(timeout=1)
                pytest.fail(f"the victim's inbox received {msg.data!r} headers {msg.headers!r}")
            release.set()
            mine = wire.decode((await got.next_msg(timeout=5)).data, RemotePrefillReply)
            assert mine.request_id == "victim"
        finally:
            await served.stop()
            for nc in (server_nc, victim, attacker):
                await nc.close()

    asyncio.run(go())


class SteeredPrefill(PrefillService):
    """A real prefill worker whose every answer reaches the decode worker as another request's would when
    steered into its inbox: other ids and an attacker's first token (its KV push is the real one)."""

    async def _on_prefill(self, req, ctx):  # noqa: ANN001, ANN201
        real = await super()._on_prefill(req, ctx)
        return real.model_copy(update={"request_id": "attacker", "transfer_id": "attacker-transfer",
                                       "first_token_id": 7})


def test_a_decode_worker_takes_no_prefill_reply_of_another_request(nats_server, checkpoints, hf_reference):  # noqa: ANN001, F811
    ckpt = checkpoints["qwen2"]
    prompt = random_prompts([40], seed=5)[0]
    decode = decode_service(ckpt, threshold=0)
    prefill = prefill_service(ckpt)
    prefill.__class__ = SteeredPrefill

    async def main() -> list[int]:
        async with running(nats_server, prefill, decode) as nc:
            tokens, _ = await asyncio.wait_for(generate(nc, prompt, greedy(6, None), "victim"), 60)
            await wait_idle(decode, prefill)
            assert decode.remote_fallbacks == 1 and decode.remote_prefills == 0
            return tokens

    tokens = asyncio.run(main())
    ref, _ = hf_reference(ckpt, prompt, 6)
    assert tokens == ref, "the victim's output took the steered reply's first token"
