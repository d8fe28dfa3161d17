"""`kvmesh bench tiers`: time to first token of a long prompt whose prefix sits in each KV tier, in one run.

Real services on a real nats-server: one decode worker (local prefill, a host tier, the kvstore on)
and a kvstore with a CPU tier over a disk tier in a temporary directory. For each tier a fresh prompt
is computed once (which also offloads it to the kvstore), then placed:
  device   still in the worker's prefix cache
  host     dropped from the device cache into the worker's host tier
  kvstore  dropped from the device (host tier emptied): fetched from the kvstore's memory
  disk     as kvstore, and the kvstore's memory spilled to its disk tier
  none     a prompt nobody computed: the whole prefill
and asked again with a different last token, so all its full blocks but the last can be reused.
The ratios to `none` are what the targets speak of (disk at most 0.5x of the recompute on CPU).

Then a shared-prefix workload whose prefixes do not fit in the device pool: `--prefixes` prefixes,
each asked `--uses` times with its own suffix, round robin (so a prefix is evicted between its uses),
two at a time; output tokens per second with the tiers (host tier + kvstore) and without, same pool.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import uuid

import torch

from loadtest.offline import model_dir
from loadtest.shapes import SHAPES
from loadtest.workload import machine_info, random_tokens, read_shape, warn_if_busy, write_result
from shared.bus.natsd import NatsServer

TIERS = ("device", "host", "kvstore", "disk", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint dir (default: build --shape in a temp dir)")
    p.add_argument("--shape", choices=["bench", *SHAPES], default="bench")
    p.add_argument("--prompt-len", type=int, default=4000, help="prompt tokens (default 4000: the bench model's "
                   "context is 4096)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="device KV pool (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefixes", type=int, default=8, help="shared-prefix workload: distinct prefixes")
    p.add_argument("--uses", type=int, default=4, help="shared-prefix workload: requests per prefix")
    p.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix workload: prefix tokens "
                   "(a long system prompt or document)")
    p.add_argument("--output-len", type=int, default=8, help="shared-prefix workload: tokens generated per request")
    p.add_argument("--pool-blocks", type=int, default=300,
                   help="shared-prefix workload: device KV blocks (two requests at a time, about 2 prefixes)")


async def measure(model: str, args: argparse.Namespace) -> dict:
    from services.decode.service import DecodeService, DecodeSettings
    from services.kvstore.cpu_tier import CPUTier
    from services.kvstore.disk_tier import DiskTier
    from services.kvstore.service import KVStoreService
    from services.kvstore.tiered import TieredStore
    from shared import bus, subjects
    from shared.block_hash import hash_blocks
    from shared.config import EngineConfig
    from shared.protocol.generate import GenerateRequest, TokenChunk
    from shared.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    results: dict[str, list[tuple[float, int]]] = {t: [] for t in TIERS}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as tmp, NatsServer(workdir=tmp) as nats:
        store = TieredStore(CPUTier(8 << 30), DiskTier(f"{tmp}/disk", 32 << 30), disk_min_uses=1)
        kvstore = KVStoreService(store)
        # Write-through: each prompt is in the kvstore once computed, so every tier can be set up and
        # timed; the shared-prefix workload below runs the default policy.
        cfg = EngineConfig(model=model, device=args.device, kv_cache_bytes=args.kv_cache_bytes,
                           host_kv_bytes=8 << 30, max_num_batched_tokens=max(args.prompt_len, 2048),
                           offload_policy="write-through")
        decode = DecodeService(cfg, DecodeSettings("d-tiers", remote_prefill_threshold=1 << 30))
        conns = [await bus.connect(nats.url) for _ in range(3)]
        nc = conns[0]
        await kvstore.start(conns[1])
        await decode.start(conns[2])
        vocab = decode.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)
        loop = asyncio.get_running_loop()

        async def ttft(prompt: list[int]) -> tuple[float, int]:
            req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=params)
            t0 = time.perf_counter()
            async with await bus.request_stream(nc, subjects.decode_generate("d-tiers"), req, timeout=600,
                                                expect=TokenChunk) as stream:
                async for chunk in stream:
                    return time.perf_counter() - t0, chunk.num_cached_tokens or 0
            raise RuntimeError("no token")

        async def offloaded(prompt: list[int]) -> None:
            """Until the kvstore holds the prompt's blocks (offload is asynchronous)."""
            want = (len(prompt) - 1) // decode.block_size
            bm = decode.engine.block_manager
            hashes = hash_blocks(bm.root, prompt, bm.block_size)
            for _ in range(600):
                held = await loop.run_in_executor(kvstore._io, store.contains_chain, hashes[:want])
                if held >= want:
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("the kvstore never got the prompt's blocks")

        def drop_device(spill_to_host: bool):  # noqa: ANN202
            def go(e) -> None:  # noqa: ANN001 - the engine, on its thread
                e.block_manager.reset_prefix_cache()
                if spill_to_host:
                    e.tiers.spill()
                else:
                    e.tiers.forget_evicted()
            return go

        for _ in range(args.repeats):
            for tier in TIERS:
                prompt = random_tokens(rng, args.prompt_len, vocab)
                if tier != "none":
                    await ttft(prompt)
                    await offloaded(prompt)
                    if tier != "device":
                        await decode.thread.call(drop_device(spill_to_host=tier == "host"))
                    if tier in ("kvstore", "disk"):
                        await decode.thread.call(lambda e: e.tiers.clear_host())
                    if tier == "disk":
                        await loop.run_in_executor(kvstore._io, store.evict, 1 << 62)  # memory -> disk
                        assert store.cpu.stats().blocks == 0 and store.disk.stats().blocks > 0
                again = prompt[:-1] + [(prompt[-1] + 1) % vocab]
                results[tier].append(await ttft(again))
        await decode.drain(2.0)
        await kvstore.drain(2.0)
        for c in conns:
            await c.close()
    out: dict = {}
    none_s = statistics.median(s for s, _ in results["none"])
    for tier, runs in results.items():
        s = statistics.median(x for x, _ in runs)
        out[tier] = {"ttft_s": s, "ratio_to_recompute": s / none_s, "cached_tokens": [n for _, n in runs],
                     "runs_s": [x for x, _ in runs]}
    return out


async def shared_prefix(model: str, args: argparse.Namespace, tiers: bool) -> dict:
    """Output tokens/s of the shared-prefix workload on one decode worker, with or without the tiers."""
    from services.decode.service import DecodeService, DecodeSettings
    from services.kvstore.cpu_tier import CPUTier
    from services.kvstore.service import KVStoreService
    from shared import bus, subjects
    from shared.config import EngineConfig
    from shared.protocol.generate import GenerateRequest, TokenChunk
    from shared.sampling_params import SamplingParams

    rng = random.Random(args.seed + 1)
    out_tokens = args.output_len
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as tmp, NatsServer(workdir=tmp) as nats:
        cfg = EngineConfig(model=model, device=args.device, num_kv_blocks=args.pool_blocks,
                           host_kv_bytes=(8 << 30) if tiers else 0, max_num_batched_tokens=2048)
        decode = DecodeService(cfg, DecodeSettings("d-shared", remote_prefill_threshold=1 << 30, use_kvstore=tiers))
        services = [KVStoreService(CPUTier(8 << 30))] if tiers else []
        conns = [await bus.connect(nats.url) for _ in range(2 + len(services))]
        for service, conn in zip(services + [decode], conns[1:]):
            await service.start(conn)
        vocab = decode.engine.model_config.vocab_size
        prefixes = [random_tokens(rng, args.prefix_len, vocab) for _ in range(args.prefixes)]
        prompts = [p + random_tokens(rng, 32, vocab) for _ in range(args.uses) for p in prefixes]  # round robin
        params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
        cached: list[int] = []

        async def one(prompt: list[int]) -> None:
            req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=params)
            async with await bus.request_stream(conns[0], subjects.decode_generate("d-shared"), req, timeout=600,
                                                expect=TokenChunk) as stream:
                async for chunk in stream:
                    if chunk.num_cached_tokens is not None:
                        cached.append(chunk.num_cached_tokens)
                    if chunk.finished:
                        return

        queue = list(prompts)
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                await one(queue.pop(0))

        await asyncio.gather(worker(), worker())
        seconds = time.perf_counter() - t0
        await decode.drain(2.0)
        for service in services:
            await service.drain(2.0)
        for c in conns:
            await c.close()
    return {"requests": len(prompts), "seconds": seconds, "output_tokens_per_s": len(prompts) * out_tokens / seconds,
            "prompt_tokens_reused": sum(cached), "prompt_tokens": sum(map(len, prompts))}


def run(args: argparse.Namespace) -> int:
    warn_if_busy()
    with model_dir(args) as model:
        print(f"TTFT of a {args.prompt_len}-token prompt by the tier holding its prefix ...", file=sys.stderr)
        tiers = asyncio.run(measure(model, args))
        print(f"shared-prefix workload ({args.prefixes} prefixes x {args.uses} uses, {args.pool_blocks}-block pool) "
              "with and without the tiers ...", file=sys.stderr)
        shared = {"with_tiers": asyncio.run(shared_prefix(model, args, tiers=True)),
                  "without_tiers": asyncio.run(shared_prefix(model, args, tiers=False))}
        shared["speedup"] = shared["with_tiers"]["output_tokens_per_s"] / shared["without_tiers"]["output_tokens_per_s"]
        result = {"prompt_len": args.prompt_len, "model": read_shape(model), "device": args.device, "tiers": tiers,
                  "shared_prefix": {"prefixes": args.prefixes, "uses": args.uses, "prefix_len": args.prefix_len,
                                    "pool_blocks": args.pool_blocks, **shared},
                  "machine": machine_info(args.device), "torch_threads": torch.get_num_threads()}
    for tier, t in tiers.items():
        print(f"{tier:>8}: TTFT {t['ttft_s'] * 1e3:8.1f} ms  ({t['ratio_to_recompute']:.2f}x of recomputing; "
              f"cached tokens {t['cached_tokens']})")
    sp = result["shared_prefix"]
    print(f"shared prefixes: {sp['with_tiers']['output_tokens_per_s']:.1f} tok/s with the tiers, "
          f"{sp['without_tiers']['output_tokens_per_s']:.1f} without ({sp['speedup']:.2f}x; prompt tokens reused "
          f"{sp['with_tiers']['prompt_tokens_reused']} vs {sp['without_tiers']['prompt_tokens_reused']})")
    write_result(args.json, result)
    return 0
