"""Issue 22: a TP=2 prefill worker whose rank 1 is SIGKILLed mid-prefill loses no request. Its engine fails with
TPRankError, every prompt it held is answered MOVE_ELSEWHERE at once, and the decode worker asks the prefill queue
group again (a TP=1 prefill worker started meanwhile takes them; the failed one refuses while it drains, and a
second failure computes locally): greedy tokens equal transformers', well before any remote-prefill timeout.
Real nats-server, real services, a real follower process."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch.distributed as dist

from shared import bus
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import decode_service, generate, prefill_service, running, wait_idle
from tests.nats_fixtures import nats_server  # noqa: F401

MAX_NEW = 6
REMOTE_TIMEOUT_S = 60.0  # a prompt that waited for it would fail the time bound below


def test_a_prefill_worker_losing_a_rank_mid_prefill_moves_its_prompts(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["qwen3"]
    prompts = random_prompts([400, 380, 360], seed=31)
    decode = decode_service(ckpt, threshold=0, kvstore=False, remote_timeout=REMOTE_TIMEOUT_S, num_kv_blocks=128)
    p0 = prefill_service(ckpt, kvstore=False, long_prefill_token_threshold=16, tensor_parallel_size=2,
                         num_kv_blocks=128)
    p1 = prefill_service(ckpt, kvstore=False, num_kv_blocks=128)

    async def main():
        async with running(nats_server, p0, decode) as nc:
            closed = asyncio.ensure_future(p0.wait_closed())  # what the service runner awaits
            follower = p0.engine.tp.procs[0]
            jobs = [asyncio.ensure_future(generate(nc, p, greedy(MAX_NEW, None), f"r{i}"))
                    for i, p in enumerate(prompts)]
            end = time.monotonic() + 60
            while (len(p0.pending) < len(prompts) or p0.kv_pieces == 0) and time.monotonic() < end:
                await asyncio.sleep(0.002)
            assert len(p0.pending) == len(prompts) and p0.kv_pieces > 0, "not mid-prefill on the TP worker"
            await p1.start(await bus.connect(nats_server))  # where the prompts can go
            t0 = time.monotonic()
            os.kill(follower.pid, signal.SIGKILL)
            results = await asyncio.gather(*jobs)
            moved_s = time.monotonic() - t0
            for p, (tokens, chunks) in zip(prompts, results):
                assert tokens == hf_reference(ckpt, p, MAX_NEW)[0]
                assert chunks[-1].finish_reason == "length"
            assert moved_s < REMOTE_TIMEOUT_S / 3, f"prompts waited {moved_s:.1f} s: a timeout, not a move"
            assert p0.moved == len(prompts) == decode.prefill_moves
            with pytest.raises(RuntimeError, match="TPRankError"):
                await asyncio.wait_for(closed, 30)
            await wait_idle(decode, p1)
            await p1.drain(2.0)
        assert follower.poll() == -signal.SIGKILL
        assert p0.engine.tp.closed and not dist.is_initialized()

    asyncio.run(main())
