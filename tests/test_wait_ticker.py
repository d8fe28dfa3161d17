"""Watched reply streams share one timer per event loop (shared/bus/wait_ticker.py): on a real nats-server,
hundreds of streams that wait with a watch keep the loop's timer heap at a handful of entries instead of one
timer per stream, every waiting stream is still checked each interval, a check that raises ends only its own
stream, a stream whose items come faster than the interval is never checked, and the idle timeout still ends
a wait."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from shared import bus, subjects
from shared import protocol as p
from shared.bus.errors import BusTimeout
from tests.nats_fixtures import nats_server  # noqa: F401 - a fixture

STREAMS = 300
INTERVAL = 0.05


class Gone(Exception):
    pass


def test_many_watched_streams_share_one_timer(nats_server: str) -> None:  # noqa: F811
    replies: asyncio.Queue[tuple[str, bus.StreamReply]] = asyncio.Queue()

    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> None:
        await replies.put((req.request_id, ctx.stream()))

    async def body() -> None:
        loop = asyncio.get_running_loop()
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        try:
            checks: Counter[int] = Counter()
            streams = []
            for i in range(STREAMS):
                s = await bus.request_stream(nc, subjects.DECODE_GENERATE,
                                             p.GenerateRequest(request_id=str(i), prompt_token_ids=[1]),
                                             expect=p.TokenChunk, timeout=30)

                def check(i: int = i) -> None:
                    checks[i] += 1
                    if i == 7 and checks[i] >= 3:
                        raise Gone()

                s.watch(check, INTERVAL)
                streams.append(s)
            senders = {}
            while len(senders) < STREAMS:
                rid, out = await replies.get()
                senders[int(rid)] = out
            readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
            timers = []
            for _ in range(10):
                await asyncio.sleep(INTERVAL)
                timers.append(len(loop._scheduled))  # noqa: SLF001 - the heap of pending timers is what is measured
            # Before: one timer per waiting stream (300+). Now: the ticker's, and the test's own sleep.
            assert max(timers) < 20, timers
            # Every stream waiting was checked, over and over; stream 7 raised on its third check and ended alone.
            assert min(checks[i] for i in range(STREAMS)) >= 3, min(checks.values())
            with pytest.raises(Gone):
                await readers[7]
            assert sum(r.done() for r in readers) == 1
            # A stream whose items come faster than the interval is never checked.
            before = checks[3]
            for seq in range(8):
                await senders[3].send(p.TokenChunk(request_id="3", seq=seq, token_ids=[seq]))
                assert (await readers[3]).seq == seq
                readers[3] = asyncio.ensure_future(streams[3].__anext__())
                await asyncio.sleep(INTERVAL / 5)
            assert checks[3] == before
            for r in readers:
                r.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            for s in streams:
                await s.aclose()

            # The idle timeout still ends a watched wait, on the ticker's clock.
            s = await bus.request_stream(nc, subjects.DECODE_GENERATE,
                                         p.GenerateRequest(request_id="idle", prompt_token_ids=[1]),
                                         expect=p.TokenChunk, timeout=0.3)
            s.watch(lambda: None, INTERVAL)
            t0 = time.monotonic()
            with pytest.raises(BusTimeout):
                await s.__anext__()
            assert 0.25 <= time.monotonic() - t0 < 2
        finally:
            await served.stop()
            await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))
