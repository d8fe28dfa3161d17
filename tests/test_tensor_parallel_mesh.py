"""Prefill and decode workers at different tensor-parallel degrees on a real nats-server: KV pushed by a TP=1
prefill worker is scattered by heads into a TP=2 decode worker's shards (and the reverse: gathered from a TP=2
prefill worker's ranks into whole blocks), and blocks a TP=2 worker offloads to the kvstore serve a TP=1 worker;
greedy tokens equal transformers'. (One TP engine per process: the other worker of each pair runs at TP=1.)"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_up_spec_passes_each_roles_degree() -> None:
    from shared.launcher.process_spec import MeshOptions, mesh_services

    args = {s.service: " ".join(s.args) for s in mesh_services(MeshOptions(model="m", prefill_tp=1, decode_tp=2))}
    assert "--tensor-parallel-size 2" in args["decode"] and "--tensor-parallel-size" not in args["prefill"]
    with pytest.raises(AssertionError, match="--decode-tp and --prefill-tp must be >= 1"):
        MeshOptions(decode_tp=0)


@pytest.mark.slow
def test_kvmesh_up_prefill_tp1_decode_tp2_exact(tmp_path) -> None:
    """The whole mesh through the launcher (`kvmesh up --prefill-tp 1 --decode-tp 2`, every prompt prefilled
    remotely): a long prompt's completion over HTTP equals the single-device engine's greedy tokens; a second
    request hits the decode worker's prefix cache; Ctrl-C leaves no rank behind."""
    import signal
    import subprocess
    import sys

    import openai

    from shared.bus.natsd import free_port
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.launcher.up import READY
    from shared.models.demo import build_demo_model
    from shared.sampling_params import SamplingParams
    from tests.test_launcher import ROOT, Lines, _alive, _env

    model = build_demo_model(tmp_path / "demo")
    prompt = random_prompts([120], seed=31, vocab=200)[0]
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    expected = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0].output_token_ids
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--model", str(model), "--port", str(port), "--prefill-tp", "1",
         "--decode-tp", "2", "--remote-prefill-threshold", "0", "--kvstore-disk-dir", str(tmp_path / "kvs"),
         "--startup-timeout", "150"],
        cwd=ROOT, env=_env(KVMESH_CPU_DTYPE="float32"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = Lines(proc.stdout)
        base = out.wait_for(rf"{READY} (http://\S+)/v1", timeout=180)[1]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60)
        name = client.models.list().data[0].id
        for _ in range(2):
            got = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            ids = [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]
            assert ids == expected
        ranks = [int(m[1]) for line in out.lines if (m := re.search(r"followers pids \[(\d+)\]", line))]
        assert len(ranks) == 1, "one decode worker of two ranks"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, "\n".join(out.lines[-30:])
        assert not _alive(ranks[0]), "the follower rank outlived its worker"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _prefill_process(nats_url: str, ckpt, tp: int, worker_id: str) -> subprocess.Popen:  # noqa: ANN001
    """A prefill worker in its own process, as `kvmesh up` runs one (one TP engine per process: the decode worker
    of the pair is tensor-parallel in this one)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(
        [sys.executable, "-m", "services.prefill", "--nats-url", nats_url, "--model", str(ckpt.path), "--dtype",
         "float32", "--device", "cpu", "--num-kv-blocks", "128", "--no-kvstore", "--long-prefill-token-threshold",
         "32", "--tensor-parallel-size", str(tp), "--threads", "1", "--worker-id", worker_id], env=env)


@pytest.mark.parametrize("rank_kv", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["rank-to-rank", "via-rank0"])
def test_equal_degrees_send_kv_rank_to_rank(nats_server, checkpoints, hf_reference, rank_kv):
    """Prefill TP=2 -> decode TP=2: each prefill rank's KV heads go straight to the matching decode rank over the
    direct channel (rank 0 writes only its own shard: no whole block is scattered); --no-rank-kv keeps the
    through-rank-0 path. Greedy tokens equal transformers' either way (a rank missing its heads would not); a rank
    that cannot send its heads gives the transfer up and decode computes the prompt itself."""
    from shared import bus
    from tests.nats_fixtures import wait_discoverable

    ckpt = checkpoints["qwen3"]  # 2 KV heads: one per rank
    prompts = random_prompts([40, 90, 130], seed=27)
    decode = decode_service(ckpt, threshold=0, kvstore=False, tensor_parallel_size=2, num_kv_blocks=128,
                            remote_timeout=60.0)
    decode.settings.rank_kv = rank_kv
    proc = _prefill_process(nats_server, ckpt, 2, "p-tp2")
    try:
        async def main():
            nc0 = await bus.connect(nats_server)
            await wait_discoverable(nc0, subjects.SERVICE_PREFILL, timeout=120)
            await nc0.drain()
            async with running(nats_server, decode) as nc:
                assert len(decode.kv_rank_endpoints) == (1 if rank_kv else 0)
                results = await asyncio.gather(*(generate(nc, p, greedy(MAX_NEW, None), f"r{i}")
                                                 for i, p in enumerate(prompts)))
                for p, (tokens, _) in zip(prompts, results):
                    assert tokens == hf_reference(ckpt, p, MAX_NEW)[0]
                await wait_idle(decode)
                assert (decode.remote_prefills, decode.remote_fallbacks) == (len(prompts), 0)
                writes = await decode.thread.call(lambda e: (e.runner.shard_writes, e.runner.whole_writes))
                assert (writes[0] > 0, writes[1] == 0) == (rank_kv, rank_kv), writes
                assert await decode.thread.call(lambda e: e.runner._shard_transfers) == {}
                if rank_kv:
                    # Rank 1's receiver out of reach: the prefill's follower cannot send its heads, so the whole
                    # transfer is given up at its last piece and decode computes the prompt itself.
                    decode.kv_rank_endpoints = ["tcp://127.0.0.1:9"]
                    extra = random_prompts([70], seed=28)[0]
                    tokens, _ = await generate(nc, extra, greedy(MAX_NEW, None), "r-unreachable")
                    assert tokens == hf_reference(ckpt, extra, MAX_NEW)[0]
                    await wait_idle(decode)
                    assert decode.remote_fallbacks == 1  # (rank 0's earlier pieces may have landed: recomputed)
                    assert await decode.thread.call(lambda e: e.runner._shard_transfers) == {}

        asyncio.run(main())
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
