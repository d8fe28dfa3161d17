"""A cancel that overtakes its prefill request (the decode worker gave the prompt up, or fell back to computing it,
before the prefill worker took the request off the bus) is remembered: the request is refused when it comes
instead of computing a prompt nobody waits for, holding the prefill worker's blocks meanwhile. Real nats-server,
a real prefill worker on a tiny checkpoint."""
from __future__ import annotations

import asyncio

from shared import bus, subjects
from shared.protocol.generate import CancelRequest
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest
from shared.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.mesh_helpers import prefill_service, running
from tests.nats_fixtures import nats_server  # noqa: F401 - a fixture


def test_a_cancel_that_overtakes_its_prefill_request_refuses_it(nats_server, tmp_path) -> None:  # noqa: ANN001, F811
    model = build_checkpoint("llama", tmp_path / "llama")
    prefill = prefill_service(model, kvstore=False)

    async def go() -> None:
        async with running(nats_server, prefill) as nc:
            prompt = list(range(1, 70))

            def req(rid: str) -> RemotePrefillRequest:
                return RemotePrefillRequest(request_id=rid, transfer_id=f"t-{rid}", prompt_token_ids=prompt,
                                            num_cached_tokens=0, decode_worker_id="nobody",
                                            num_dest_blocks=-(-len(prompt) // prefill.block_size),
                                            block_size=prefill.block_size, sampling=SamplingParams(max_tokens=4))

            await bus.publish(nc, subjects.PREFILL_CANCEL, CancelRequest(request_id="late", reason="fallback"))
            await nc.flush()
            await asyncio.sleep(0.2)  # the cancel handled first, as when the request waited on the bus
            reply = await bus.request(nc, subjects.PREFILL_PREFILL, req("late"), timeout=10, expect=RemotePrefillReply)
            assert reply.error == "cancelled" and reply.first_token_id is None
            assert prefill.refused_cancelled == 1
            held, free, total = await prefill.thread.call(lambda e: (len(e.scheduler.requests),
                                                                       e.block_manager.num_free_blocks,
                                                                       e.block_manager.num_blocks))
            assert held == 0 and free == total
            # Remembered once: the same id asked again is computed (its push then fails: nobody takes it).
            again = await bus.request(nc, subjects.PREFILL_PREFILL, req("late"), timeout=30, expect=RemotePrefillReply)
            assert again.error != "cancelled" and prefill.refused_cancelled == 1
    asyncio.run(go())
