"""Prefill and decode workers at different tensor-parallel degrees on a real nats-server: KV pushed by a TP=1
prefill worker is scattered by heads into a TP=2 decode worker's shards (and the reverse: gathered from a TP=2
prefill worker's ranks into whole blocks), and blocks a TP=2 worker offloads to the kvstore serve a TP=1 worker;
greedy tokens equal transformers'. (One TP engine per process: the other worker of each pair runs at TP=1.)"""
from __future__ import annotations

import asyncio

import pytest

from shared import subjects
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import decode_service, generate, kvstore_service, prefill_service, running, wait_idle
from tests.nats_fixtures import nats_server  # noqa: F401

MAX_NEW = 10


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)], ids=["p1-d2", "p2-d1"])
def test_remote_prefill_across_degrees_matches_transformers(nats_server, checkpoints, hf_reference, prefill_tp,
                                                            decode_tp):
    ckpt = checkpoints["qwen3"]  # 4 query heads, 2 KV heads: one KV head per rank at TP=2
    prompts = random_prompts([16, 40, 90], seed=21)
    decode = decode_service(ckpt, threshold=0, tensor_parallel_size=decode_tp)
    prefill = prefill_service(ckpt, long_prefill_token_threshold=32, tensor_parallel_size=prefill_tp)

    async def main():
        async with running(nats_server, kvstore_service(), prefill, decode) as nc:
            results = await asyncio.gather(*(generate(nc, p, greedy(MAX_NEW, None), f"r{i}")
                                             for i, p in enumerate(prompts)))
            for p, (tokens, _) in zip(prompts, results):
                assert tokens == hf_reference(ckpt, p, MAX_NEW)[0]
            await wait_idle(decode, prefill)
            assert (decode.remote_prefills, decode.remote_fallbacks) == (len(prompts), 0)
            assert prefill.kv_pieces > 0

    asyncio.run(main())


def test_blocks_a_tp2_worker_offloads_serve_a_tp1_worker(nats_server, checkpoints, hf_reference):
    ckpt = checkpoints["llama"]
    shared = random_prompts([80], seed=25)[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    d0 = decode_service(ckpt, worker_id="d0", threshold=10_000, offload_policy="write-through",
                        tensor_parallel_size=2)
    d1 = decode_service(ckpt, worker_id="d1", threshold=10_000, offload_policy="write-through")
    store = kvstore_service()

    async def main():
        async with running(nats_server, store, d0, d1) as nc:
            tokens, _ = await generate(nc, first, greedy(MAX_NEW, None), "a", subjects.decode_generate("d0"))
            assert tokens == hf_reference(ckpt, first, MAX_NEW)[0]
            await d0.offloader.flush(5)
            assert store.tier.stats().blocks >= 5
            tokens, chunks = await generate(nc, second, greedy(MAX_NEW, None), "b", subjects.decode_generate("d1"))
            assert tokens == hf_reference(ckpt, second, MAX_NEW)[0]
            assert chunks[0].num_cached_tokens == 80, "d1 never saw the prefix: it must come from the kvstore"
            await wait_idle(d0, d1)

    asyncio.run(main())
