"""A stream's chunks count only from the worker the request was routed to (issue 20 item 2): a forger who
learned a request's reply subject (here: it subscribes to the request subject of an open bus) answers first
with a forged "stop" chunk and a forged end; the requester ignores both and gets the worker's stream."""
from __future__ import annotations

import asyncio

from shared import bus, wire
from shared.bus import headers as H
from shared.bus.natsd import NatsServer
from shared.protocol.generate import GenerateRequest, TokenChunk
from shared.sampling_params import SamplingParams


def test_forged_chunks_from_another_sender_are_ignored(tmp_path) -> None:  # noqa: ANN001
    async def go(url: str) -> list[TokenChunk]:
        worker, forger, gateway = [await bus.connect(url) for _ in range(3)]
        bus.set_sender(worker, "w1")

        async def generate(req: GenerateRequest, ctx: bus.RequestContext):  # noqa: ANN202
            await asyncio.sleep(0.2)  # the forger is faster
            for i in range(3):
                yield TokenChunk(request_id=req.request_id, seq=i, token_ids=[10 + i],
                                 finish_reason="length" if i == 2 else None)

        async def forge(msg) -> None:  # noqa: ANN001
            bad = TokenChunk(request_id="r", seq=0, token_ids=[666], finish_reason="stop")
            await forger.publish(msg.reply, wire.encode(bad), headers={H.SEQ: "0"})  # no sender at all
            await forger.publish(msg.reply, wire.encode(bad), headers={H.SEQ: "0", H.FROM: "w2"})
            await forger.publish(msg.reply, b"", headers={H.END: "0", H.FROM: "w2"})

        await bus.serve(worker, "kvmesh.test.gen", None, generate, GenerateRequest)
        await forger.subscribe("kvmesh.test.gen", cb=forge)
        await forger.flush()
        req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams())
        chunks = []
        async with await bus.request_stream(gateway, "kvmesh.test.gen", req, timeout=5, expect=TokenChunk,
                                            sender="w1") as stream:
            async for c in stream:
                chunks.append(c)
                if c.finished:
                    break
        for nc in (worker, forger, gateway):
            await nc.close()
        return chunks

    with NatsServer(workdir=tmp_path) as server:
        chunks = asyncio.run(go(server.url))
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12] and chunks[-1].finish_reason == "length"
