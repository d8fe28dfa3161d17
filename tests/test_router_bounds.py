"""The router's memory is bounded (issue 20 item 5): 600 block events carrying 1.2 million random hashes for
made-up worker ids grew the gateway from 101 to 247 MB for good. Router state now exists only for workers
that beat, is forgotten when they stop, and each block set is capped (oldest dropped)."""
from __future__ import annotations

import os

from services.gateway.router import Router, RouterConfig
from shared import bus, subjects
from shared.block_hash import hash_blocks
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from tests.gateway_harness import one_decoder_mesh
from tests.test_gateway_units import ROOT, Clock, beat

MARK = b"m" * 16  # the flood's last event: its hash in d0's set says the gateway handled them all


def test_events_for_workers_that_never_beat_create_nothing() -> None:
    r = Router(RouterConfig(), Clock())
    r.on_stored(BlockStored(worker_id="ghost", hashes=[os.urandom(16) for _ in range(1000)]))
    r.on_removed(BlockRemoved(worker_id="ghost2", hashes=[b"x" * 16]))
    assert r.worker_count() == 0


def test_each_block_set_is_capped_oldest_first_and_silent_workers_are_forgotten() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=1.0, max_worker_hashes=50, forget_after_expiries=10), clock)
    r.on_beat(beat("a", free=20))  # a pool of 100 blocks (beat()'s total)
    prompt = list(range(40))
    chain = hash_blocks(ROOT, prompt, 4)
    r.on_stored(BlockStored(worker_id="a", hashes=[os.urandom(16) for _ in range(500)]))
    r.on_stored(BlockStored(worker_id="a", hashes=chain))  # the newest survive the cap
    r.on_stored(BlockStored(worker_id="a", hashes=[os.urandom(16) for _ in range(500)], tier="host"))
    w = r.alive()[0]
    assert len(w.blocks) == 50 and len(w.host_blocks) == 50
    assert r.pick(prompt).cached_blocks == len(chain)
    # The device set is also capped at the pool size the worker reports.
    r.on_beat(LoadBeat(worker_id="a", role="decode", running=0, waiting=0, free_blocks=0, total_blocks=8,
                       block_size=4, hash_root=ROOT, max_model_len=512))
    r.on_stored(BlockStored(worker_id="a", hashes=chain))
    assert len(r.alive()[0].blocks) == 8
    # Silent for ten expiry periods: gone, block sets and all, even if nobody picks in between.
    r.on_beat(beat("b"))
    clock.t += 11
    r.on_beat(beat("b"))
    assert r.worker_count() == 1 and [w.worker_id for w in r.alive()] == ["b"]


def test_a_flood_of_block_events_over_the_bus_leaves_the_router_bounded(tmp_path_factory) -> None:  # noqa: ANN001
    """The issue's attack through a real nats-server into the real gateway: 600 events of 2,000 random hashes
    for made-up ids, plus 100 for the real worker's id on its own subject, plus events whose id is not the
    subject's."""
    # The real worker must stay known through the flood: on a loaded machine the gateway can take longer than its
    # forget-after period (ten expiries) to work through 1.2 million hashes, and a forgotten worker comes back with
    # an empty block set. What is checked here is the bound, not the expiry.
    with one_decoder_mesh(tmp_path_factory, "flood", worker_expiry_s=30.0) as mesh:
        router = mesh.gateway.ctx.router
        total = mesh.gateway.ctx.router.alive()[0].beat.total_blocks

        async def flood() -> None:
            nc = await bus.connect(mesh.nats.url)
            try:
                for i in range(600):
                    wid = f"fake{i}"
                    await bus.publish(nc, subjects.decode_events(wid),
                                      BlockStored(worker_id=wid, hashes=[os.urandom(16) for _ in range(2000)]))
                for _ in range(100):
                    await bus.publish(nc, subjects.decode_events("d0"),
                                      BlockStored(worker_id="d0", hashes=[os.urandom(16) for _ in range(2000)]))
                # d0's id on another subject: ignored (a worker speaks only for itself)
                await bus.publish(nc, subjects.decode_events("fake1"), BlockStored(worker_id="d0", hashes=[b"y" * 16]))
                # Last, one more of d0's own: once the gateway holds it, it has handled everything before it (one
                # subscription, in order).
                await bus.publish(nc, subjects.decode_events("d0"), BlockStored(worker_id="d0", hashes=[MARK]))
                await nc.flush()
            finally:
                await nc.close()

        async def view() -> tuple[int, str, set[bytes], int]:
            # Read on the gateway's own loop, between its handlers: never in the middle of an event's hashes.
            (d0,) = router.alive()
            return router.worker_count(), d0.worker_id, set(d0.blocks), len(d0.host_blocks)

        mesh.call(flood(), timeout=120)
        mesh.wait_until(lambda: MARK in mesh.call(view())[2], timeout=120)
        count, worker_id, blocks, host_blocks = mesh.call(view())
        assert count == 1
        assert worker_id == "d0" and len(blocks) == total and host_blocks <= RouterConfig().max_worker_hashes
        assert b"y" * 16 not in blocks
