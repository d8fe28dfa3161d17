"""Decode and prefill services on a real nats-server: remote prefill, KV transfer, kvstore reuse,
fallbacks and cancellation, compared with transformers token for token."""
from __future__ import annotations

import asyncio

from shared import bus, subjects
from shared.protocol.generate import CancelRequest
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import (decode_service, generate, kvstore_service, prefill_service, running, wait_idle)
from tests.nats_fixtures import nats_server  # noqa: F401

MAX_NEW = 10


def check(ckpt, hf_reference, prompt, tokens):
    ref, _ = hf_reference(ckpt, prompt, MAX_NEW)
    assert tokens == ref


def test_remote_prefill_forced_matches_transformers(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["qwen2"]
    prompts = random_prompts([3, 16, 40, 90, 17], seed=21)
    decode, prefill = decode_service(ckpt, threshold=0), prefill_service(ckpt)

    async def main():
        async with running(nats_server, kvstore_service(), prefill, decode) as nc:
            results = await asyncio.gather(*(generate(nc, p, greedy(MAX_NEW, None), f"r{i}")
                                             for i, p in enumerate(prompts)))
            for p, (tokens, chunks) in zip(prompts, results):
                check(ckpt, hf_reference, p, tokens)
                assert [c.seq for c in chunks] == list(range(len(chunks)))
            await wait_idle(decode, prefill)
            assert (decode.remote_prefills, decode.remote_fallbacks) == (len(prompts), 0)

    asyncio.run(main())


def test_local_prefill_when_tail_is_short(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["llama"]
    prompts = random_prompts([5, 33, 64], seed=22)
    decode = decode_service(ckpt, threshold=10_000)

    async def main():
        async with running(nats_server, decode) as nc:  # no prefill worker, no kvstore: fully local
            for i, p in enumerate(prompts):
                tokens, _ = await generate(nc, p, greedy(MAX_NEW, None), f"l{i}")
                check(ckpt, hf_reference, p, tokens)
            await wait_idle(decode)

    asyncio.run(main())


def test_no_prefill_worker_falls_back_at_once(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["llama"]
    prompt = random_prompts([50], seed=23)[0]
    decode = decode_service(ckpt, threshold=0)

    async def main():
        async with running(nats_server, decode) as nc:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            tokens, _ = await generate(nc, prompt, greedy(MAX_NEW, None), "np")
            assert loop.time() - t0 < 5, "no responders must not wait for a timeout"
            check(ckpt, hf_reference, prompt, tokens)
            assert (decode.remote_prefills, decode.remote_fallbacks) == (0, 1)
            await wait_idle(decode)

    asyncio.run(main())


def test_dropped_and_corrupted_transfers_recompute_locally(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["mistral"]
    prompts = random_prompts([70, 21], seed=24)
    for fault in ("drop", "corrupt"):
        decode, prefill = decode_service(ckpt, threshold=0, transfer_timeout=1.5), prefill_service(ckpt, fault=fault)

        async def main():
            async with running(nats_server, prefill, decode) as nc:
                for i, p in enumerate(prompts):
                    tokens, _ = await asyncio.wait_for(generate(nc, p, greedy(MAX_NEW, None), f"{fault}{i}"), 20)
                    check(ckpt, hf_reference, p, tokens)
                assert (decode.remote_prefills, decode.remote_fallbacks) == (0, len(prompts))
                await wait_idle(decode, prefill)

        asyncio.run(main())


def test_second_worker_gets_prefix_from_kvstore(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["qwen3"]
    shared = random_prompts([80], seed=25)[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    d0 = decode_service(ckpt, worker_id="d0", threshold=10_000)
    d1 = decode_service(ckpt, worker_id="d1", threshold=10_000)
    store = kvstore_service()

    async def main():
        async with running(nats_server, store, d0, d1) as nc:
            tokens, chunks = await generate(nc, first, greedy(MAX_NEW, None), "a", subjects.decode_generate("d0"))
            check(ckpt, hf_reference, first, tokens)
            assert chunks[0].num_cached_tokens == 0
            await d0.offloader.flush(5)
            tokens, chunks = await generate(nc, second, greedy(MAX_NEW, None), "b", subjects.decode_generate("d1"))
            check(ckpt, hf_reference, second, tokens)
            assert chunks[0].num_cached_tokens == 80, "d1 never saw the prefix: it must come from the kvstore"
            assert store.tier.stats().hits > 0
            await wait_idle(d0, d1)

    asyncio.run(main())


def test_cancel_midstream_frees_everything(nats_server, checkpoints):
    ckpt = checkpoints["llama"]
    decode = decode_service(ckpt, threshold=10_000)
    prompt = random_prompts([30], seed=26)[0]

    async def main():
        async with running(nats_server, decode) as nc:
            params = greedy(400, None)
            params.ignore_eos = True
            req_task = asyncio.ensure_future(generate(nc, prompt, params, "c1"))
            await asyncio.sleep(0.5)
            await bus.publish(nc, subjects.DECODE_CANCEL, CancelRequest(request_id="c1", reason="client gone"))
            tokens, chunks = await asyncio.wait_for(req_task, 5)
            assert chunks[-1].finish_reason == "abort" and len(tokens) < 400
            await wait_idle(decode, timeout=2.0)

    asyncio.run(main())
