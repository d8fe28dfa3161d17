"""The step's pinned input buffer is never rewritten before the asynchronous copy that reads it has run.

A fake stream stands for a GPU that runs behind the host: copies are only enqueued, and run when an event
recorded after them is waited on (or at the end). Each copy records what it delivered to the device, which
must be what the host wrote for that copy's step. Steps here sample nothing, so nothing else syncs."""
from __future__ import annotations

import torch

from shared.engine.model_runner import StepBuffers
from shared.engine.staging import StagingRing


class FakeStream:
    def __init__(self) -> None:
        self.queue: list = []
        self.delivered: list[torch.Tensor] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append((dst, src))

    def record(self) -> "FakeEvent":
        event = FakeEvent(self)
        self.queue.append(event)
        return event

    def run(self, until: "FakeEvent | None" = None) -> None:
        while self.queue:
            op = self.queue.pop(0)
            if isinstance(op, FakeEvent):
                op.done = True
                if op is until:
                    return
            else:
                dst, src = op
                dst.copy_(src)
                self.delivered.append(dst.clone())


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.done = stream, False

    def synchronize(self) -> None:
        if not self.done:
            self.stream.run(until=self)


def _steps(buffers: StepBuffers, stream: FakeStream, n: int = 6) -> list[bool]:
    """n steps of different inputs uploaded back to back; per step, whether its copy delivered its inputs."""
    sent = []
    for step in range(n):
        chunks = [[step * 100 + i for i in range(5 + step)], [step] * 3, [-step]]
        views = buffers.upload(chunks)
        sent.append([(v.storage_offset(), c) for v, c in zip(views, chunks)])
    stream.run()
    assert len(stream.delivered) == n
    return [all(got[off:off + len(c)].tolist() == c for off, c in step)
            for got, step in zip(stream.delivered, sent)]


def test_each_async_copy_delivers_its_own_steps_inputs():
    stream = FakeStream()
    buffers = StepBuffers("cpu", capacity=64, stream=stream)
    assert len(buffers.ring.buffers) == 2
    assert all(_steps(buffers, stream))


def test_one_reused_buffer_without_events_is_the_race_the_fake_stream_shows():
    # What the runner did before: one host buffer, rewritten by the next step before its copy ran.
    stream = FakeStream()
    buffers = StepBuffers("cpu", capacity=64, stream=stream)
    buffers.ring = StagingRing(buffers.ring.buffers[:1], None)
    ok = _steps(buffers, stream)
    assert not all(ok[:-1]) and ok[-1], "every step but the last sent the last step's inputs"


def test_growing_the_buffer_keeps_the_ordering():
    stream = FakeStream()
    buffers = StepBuffers("cpu", capacity=8, stream=stream)
    assert all(_steps(buffers, stream, n=5))  # grows on the way (chunks outgrow 8 ints)
    assert buffers.capacity > 8


def test_the_ring_waits_only_for_the_buffer_it_hands_out():
    stream = FakeStream()
    ring = StagingRing(["a", "b"], stream)
    assert ring.acquire() == "a"
    ring.sent()
    assert ring.acquire() == "b"
    ring.sent()
    first, second = [op for op in stream.queue if isinstance(op, FakeEvent)]
    assert ring.acquire() == "a" and first.done and not second.done


def test_spilled_blocks_reach_the_host_tier_after_their_copy_at_the_end_of_the_step(checkpoints):
    """The host tier's copies out are asynchronous on CUDA: a step enqueues them (the fake event stands for
    the copies still running) and hands the blocks to the tier only at its end, after the event."""
    from tests.engine_helpers import greedy, make_engine, random_prompts

    engine = make_engine(checkpoints["qwen3"], num_kv_blocks=9, host_kv_bytes=1 << 24, max_num_batched_tokens=64)
    engine.tiers._async = True
    log: list[str] = []
    real = engine.tiers._read_async

    class Copies:
        def synchronize(self) -> None:
            log.append("copies done")

    def read_async(ids):
        k, v, _ = real(ids)
        log.append(f"spill {len(ids)}")
        return k, v, Copies()

    engine.tiers._read_async = read_async
    put = engine.tiers.host.put

    def put_logged(blocks):
        log.append(f"tier {blocks.num_blocks}")
        return put(blocks)

    engine.tiers.host.put = put_logged
    run = engine.executor.run  # the step's compute, between its spill and the end of the step

    def run_logged(eng, plan):
        log.append("step")
        return run(eng, plan)

    engine.executor.run = run_logged
    first = random_prompts([60], seed=1)[0]
    engine.generate([first], greedy(2), use_tqdm=False)
    engine.generate(random_prompts([60, 60], seed=2), greedy(2), use_tqdm=False)  # evicts the first prompt's blocks
    spills = [i for i, e in enumerate(log) if e.startswith("spill")]
    assert spills, "the second batch evicted cached blocks"
    for i in spills:
        # The spill's step runs after it, and only then do its copies complete and its blocks reach the tier.
        assert log[i + 1] == "step" and log[i + 2] == "copies done" and log[i + 3].startswith("tier"), log[i:i + 4]
    assert engine.tiers.host.stats.stored_blocks > 0 and not engine.tiers._spills
