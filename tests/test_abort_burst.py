"""A burst of cancels (the clients of an overloaded mesh leaving together) reaches the decode engine together:
the requests end between two engine steps instead of one per step while the engine goes on computing the others
for clients that are gone. Real nats-server, a real decode worker on a tiny checkpoint."""
from __future__ import annotations

import asyncio
import time

from services.decode.admission import State
from shared import bus, subjects
from shared.protocol.generate import CancelRequest, GenerateRequest, TokenChunk
from shared.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.mesh_helpers import decode_service, running, wait_idle
from tests.nats_fixtures import nats_server  # noqa: F401 - a fixture

N = 8


def _steps(engine) -> int:  # noqa: ANN001
    hist = engine.stats().iteration_tokens
    return sum(hist.counts) if hist else 0


def test_a_burst_of_cancels_ends_between_two_steps(nats_server, tmp_path) -> None:  # noqa: ANN001, F811
    model = build_checkpoint("llama", tmp_path / "llama", max_position_embeddings=1024)
    d = decode_service(model, kvstore=False, threshold=1 << 30)

    async def go() -> None:
        async with running(nats_server, d) as nc:
            params = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0)
            streams = [await bus.request_stream(nc, subjects.DECODE_GENERATE, GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=[1 + i, 2, 3, 4], sampling=params), timeout=30, expect=TokenChunk)
                for i in range(N)]
            end = time.monotonic() + 30
            while not (len(d.requests) == N and all(r.admission.state is State.RUNNING for r in d.active.values())):
                assert time.monotonic() < end, "requests not admitted"
                await asyncio.sleep(0.01)
            # The engine held in a step for a while, as a busy CPU's step is long; the clients leave meanwhile.
            at_stall = asyncio.ensure_future(d.thread.call(lambda e: (time.sleep(2.0), _steps(e))[1]))
            await asyncio.sleep(0.2)
            for i in range(N):
                await bus.publish(nc, subjects.DECODE_CANCEL, CancelRequest(request_id=f"r{i}", reason="client left"))
            await nc.flush()
            steps_at_stall = await at_stall
            await wait_idle(d, timeout=30)
            steps = await d.thread.call(_steps) - steps_at_stall
            # One abort per step would let the engine step for the rest N - 1 times; together they end at once.
            assert steps <= N // 2, f"{steps} engine steps to drop {N} cancelled requests"
            for s in streams:
                last = None
                async for chunk in s:
                    last = chunk
                    if chunk.finished:
                        break
                assert last is not None and last.finish_reason == "abort"
                await s.aclose()
    asyncio.run(go())
