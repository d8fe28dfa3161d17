"""`kvmesh bench kv-transfer`: how fast KV moves over NATS, and what that means for time to first token.

1. Transfer: one engine prefills a prompt and hands out its KV blocks; each data-plane path pushes
   them into blocks another engine reserved: NATS (chunked under max_payload through a real
   nats-server), the direct channel inline over TCP loopback, and through shared memory. Each beside
   a copy of the same bytes in memory, in the same run.
2. TTFT for a prompt of the same length through real decode/prefill/kvstore services: prefilled on
   the decode worker, by a prefill worker (remote prefill + KV push), and with the prefix served from
   the kvstore to a decode worker that never saw it.

--decode-tp / --prefill-tp: the receiving (decode) or sending (prefill) engine runs tensor-parallel, so the
figures include gathering whole blocks from the ranks' head shards or scattering them by heads (in the TTFT
part, the "remote" decode worker or the prefill worker). Both > 1: the prefill worker runs in its own process
(torch.distributed allows one TP engine per process) and the TTFT of KV through rank 0 is compared with KV sent
rank to rank (equal degrees), round by round on the same workers. On this CPU TP is for correctness: the
figures show what resharding costs, not a speed-up.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
import uuid

import torch

from loadtest.offline import model_dir
from loadtest.shapes import SHAPES
from shared.bus.natsd import NatsServer
from shared.kv_blocks import KVBlocks
from loadtest.workload import machine_info, random_tokens, read_shape, warn_if_busy, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint dir (default: build --shape in a temp dir)")
    p.add_argument("--shape", choices=["bench", *SHAPES], default="bench",
                   help="architecture of the random-weight checkpoint built when --model is not given")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="KV pool of each engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of the receiving decode engine")
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of the sending prefill engine")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="the prefill worker's long_prefill_token_threshold (default: a prefill worker's default; "
                        "0: the whole prompt in one step, its KV pushed at the end)")


def _engine_config(model: str, args: argparse.Namespace):
    from shared.config import EngineConfig

    return EngineConfig(model=model, dtype="float32", kv_cache_bytes=args.kv_cache_bytes)


PATHS = ("nats", "tcp", "shm")


def _transports(path: str, nc_send, nc_recv):  # noqa: ANN001, ANN202
    """(sender, receiver) for one data-plane path: NATS chunks, the direct channel inline over TCP, or
    the direct channel through shared memory."""
    from shared.kv_transport import MeshKVTransport, NatsKVTransport
    from shared.kv_transport.direct import DirectSettings

    if path == "nats":
        return NatsKVTransport(nc_send), NatsKVTransport(nc_recv)
    settings = DirectSettings(shared_memory=path == "shm")
    return MeshKVTransport(nc_send, settings=settings), MeshKVTransport(nc_recv, kv_host="127.0.0.1", settings=settings)


async def measure_transfer(model: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """Each path moves the same prompt's KV into blocks another engine reserved; beside a copy of the
    same bytes in memory, in the same run. Sender and receiver share this process and its event loop,
    so the shared-memory path pays both of its copies on one core (two processes would overlap them)."""
    import secrets

    from shared import bus
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    base = _engine_config(model, args)
    src = LLMEngine(dataclasses.replace(base, tensor_parallel_size=args.prefill_tp))
    dst = LLMEngine(dataclasses.replace(base, tensor_parallel_size=args.decode_tp))
    vocab = src.model_config.vocab_size
    paths: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-nats-") as tmp, NatsServer(workdir=tmp) as nats:
        url = nats.url
        nc_send, nc_recv = await bus.connect(url), await bus.connect(url)
        chunk_limit = nc_send.max_payload
        for path in PATHS:
            sender, receiver = _transports(path, nc_send, nc_recv)
            await sender.start(None)
            await receiver.start("bench")
            runs = []
            for i in range(args.repeats + 1):  # the first run warms up (and opens the direct connection)
                prompt = random_tokens(rng, args.prompt_len, vocab)
                params = SamplingParams(max_tokens=1, temperature=0.0)
                rid = f"{path}{i}"
                src.add_request(rid, prompt, params, capture_kv_from_block=0)
                k, v = _prefill_kv(src)
                res = dst.reserve(rid, prompt, params)

                async def write(blocks, rid=rid):  # noqa: ANN001
                    dst.write_blocks(rid, blocks)

                tid, token = uuid.uuid4().hex, secrets.token_bytes(16)
                done = receiver.expect(tid, res.num_blocks, write, 120, token=token)
                t0 = time.perf_counter()
                sent = await sender.send("bench", tid, KVBlocks(k, v), 120, endpoint=receiver.endpoint, token=token)
                await done
                seconds = time.perf_counter() - t0
                copy_s = _memcpy_seconds(k, v)
                dst.abort(rid)
                if i:
                    runs.append((seconds, copy_s))
            if path != "nats":
                assert sender.direct_sends == args.repeats + 1, f"{path}: the direct channel was not used"
                server = receiver.server
                assert (server.shm_frames > 0) == (path == "shm"), f"{path}: shared memory used or not as asked"
            await sender.stop()
            await receiver.stop()
            paths[path] = _figures(sent, int(k.shape[1]), runs)
        await nc_send.drain()
        await nc_recv.drain()
    src.shutdown()  # a TP engine's ranks: the TTFT part starts its own
    dst.shutdown()
    for shm in (True, False):  # the direct channel again with the receiver in its own process, as in a mesh
        name = "shm-2proc" if shm else "tcp-2proc"
        runs = await _two_process_runs(k, v, args.repeats, shm)
        paths[name] = _figures(2 * k.numel() * k.element_size(), int(k.shape[1]), runs)
    # The NATS figures stay at the top level (earlier result files have them there).
    return {**paths["nats"], "max_payload": chunk_limit, "paths": paths}


def _figures(sent: int, blocks: int, runs: list[tuple[float, float]]) -> dict:
    """One path's report from its (seconds, memory-copy seconds) runs: medians, GB/s, ratio to the copy."""
    seconds, copy_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"bytes": sent, "blocks": blocks, "seconds": seconds, "gb_per_s": sent / seconds / 1e9,
            "memcpy_seconds": copy_s, "memcpy_gb_per_s": sent / copy_s / 1e9, "ratio_to_memcpy": copy_s / seconds,
            "runs": [{"seconds": s, "memcpy_seconds": c} for s, c in runs]}


async def _two_process_runs(k: torch.Tensor, v: torch.Tensor, repeats: int, shm: bool) -> list[tuple[float, float]]:
    """Sends k, v repeats + 1 times (the first warms up) to a receiver process; (seconds, memcpy seconds)."""
    import secrets

    from shared.kv_transport.direct import DirectSender, DirectSettings

    token = secrets.token_bytes(16)
    dtype = str(k.dtype).removeprefix("torch.")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.kv_receiver", "--shape", ",".join(map(str, k.shape)), "--dtype", dtype,
        "--transfers", str(repeats + 1), "--token", token.hex(), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    sender = DirectSender(DirectSettings(shared_memory=shm))
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)  # type: ignore[union-attr]
        endpoint = f"tcp://127.0.0.1:{int(line.split()[1])}"
        seconds = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            await sender.send(endpoint, token, f"t{i}", KVBlocks(k, v), 120)
            seconds.append(time.perf_counter() - t0)
        assert sender.uses_shared_memory(endpoint) == shm
        # The copies are timed after the transfers, not between them: torch's copy runs on its intra-op
        # threads, which spin for a while after it and would take a core from the receiver.
        return [(s, _memcpy_seconds(k, v)) for s in seconds[1:]]
    finally:
        await sender.close()
        proc.stdin.close()  # type: ignore[union-attr]
        await asyncio.wait_for(proc.wait(), 30)


def _memcpy_seconds(k: torch.Tensor, v: torch.Tensor) -> float:
    """A memory copy of the same bytes into memory already touched (as the KV cache and the ring are):
    the ceiling any path is compared with. (Until this change the copy was a clone, which also paid
    the page faults of fresh memory and read about half as fast.)"""
    kd, vd = torch.empty_like(k), torch.empty_like(v)
    kd.copy_(k), vd.copy_(v)
    t0 = time.perf_counter()
    kd.copy_(k), vd.copy_(v)
    return time.perf_counter() - t0


def _prefill_kv(engine) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Runs the one prefill-only request to the end; its K, V (a long prompt's chunks joined)."""
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.kv_blocks is not None:
                pieces.append(out.kv_blocks)
            if out.finished:
                joined = KVBlocks.concat(pieces)
                return joined.k, joined.v
    raise RuntimeError("request did not finish")


async def measure_ttft(model: str, args: argparse.Namespace, rng: random.Random) -> dict:
    from services.decode.service import DecodeService, DecodeSettings
    from services.engine_args import PREFILL_CHUNK_TOKENS
    from services.kvstore.cpu_tier import CPUTier
    from services.kvstore.service import KVStoreService
    from services.prefill.service import PrefillService, PrefillSettings
    from shared import bus, subjects
    from shared.sampling_params import SamplingParams
    from shared.protocol.generate import GenerateRequest, TokenChunk

    # Write-through: the "kvstore" worker is timed on a prefix another worker computed once.
    cfg = dataclasses.replace(_engine_config(model, args), offload_policy="write-through")
    store = KVStoreService(CPUTier(4 << 30))
    chunk = PREFILL_CHUNK_TOKENS if args.prefill_chunk_tokens is None else args.prefill_chunk_tokens
    prefill = PrefillService(dataclasses.replace(cfg, long_prefill_token_threshold=chunk,
                                                 tensor_parallel_size=args.prefill_tp),
                             PrefillSettings(use_kvstore=False))
    workers = {
        "local": DecodeService(cfg, DecodeSettings("d-local", remote_prefill_threshold=1 << 30)),
        "remote": DecodeService(dataclasses.replace(cfg, tensor_parallel_size=args.decode_tp),
                                DecodeSettings("d-remote", remote_prefill_threshold=0, use_kvstore=False)),
        "kvstore": DecodeService(cfg, DecodeSettings("d-store", remote_prefill_threshold=1 << 30)),
    }
    vocab = None
    results: dict[str, list[float]] = {name: [] for name in workers}
    cached: list[int] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-nats-") as tmp, NatsServer(workdir=tmp) as nats:
        url = nats.url
        conns = [await bus.connect(url) for _ in range(6)]
        nc = conns[0]
        for service, conn in zip([store, prefill, *workers.values()], conns[1:]):
            await service.start(conn)
        vocab = prefill.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def ttft(worker: str, prompt: list[int]) -> tuple[float, int]:
            req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=params)
            t0 = time.perf_counter()
            async with await bus.request_stream(nc, subjects.decode_generate(worker), req, timeout=300,
                                                expect=TokenChunk) as stream:
                async for chunk in stream:
                    first = time.perf_counter() - t0
                    n = chunk.num_cached_tokens or 0
                    break
            return first, n

        for i in range(args.repeats + 1):  # the first round warms up
            prompts = {name: random_tokens(rng, args.prompt_len, vocab) for name in workers}
            # The kvstore case: another worker computed (and offloaded) this prompt before.
            await ttft("d-local", prompts["kvstore"])
            await workers["local"].offloader.flush(60)
            for name, worker in workers.items():
                t, n = await ttft(worker.settings.worker_id, prompts[name])
                if i:
                    results[name].append(t)
                    if name == "kvstore":
                        cached.append(n)
        remote_ok = workers["remote"].remote_prefills
        for service in [*workers.values(), prefill, store]:
            await service.drain(5)
        for conn in conns:
            await conn.drain()
    med = {name: statistics.median(ts) for name, ts in results.items()}
    return {"ttft_local_s": med["local"], "ttft_remote_s": med["remote"], "ttft_kvstore_s": med["kvstore"],
            "prefill_chunk_tokens": chunk, "prefill_kv_pieces": prefill.kv_pieces,
            # After the prompt's last chunk computed, until decode had every block: the push compute did not hide.
            "push_wait_ms_mean": 1e3 * prefill.kv_push.wait_s / max(prefill.kv_push.pushes, 1),
            "pushes": prefill.kv_push.pushes,
            "kvstore_cached_tokens": cached, "remote_prefills": remote_ok,
            "ratio_local_over_kvstore": med["local"] / med["kvstore"],
            "ratio_remote_over_local": med["remote"] / med["local"], "runs": results}


async def measure_ttft_both_tp(model: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """Both workers tensor-parallel (one TP engine per process): the prefill worker runs in its own process, the
    decode worker here. Rounds alternate, on the same two workers, a remote prefill whose KV goes through rank 0
    (gathered whole on the prefill side, scattered by heads here: what every transfer did before) and one sent
    rank to rank (each prefill rank's heads straight to the matching decode rank), so the difference between the
    two TTFTs is the KV path's (the prefill compute is the same); at --prefill-chunk-tokens 0 the whole push comes
    after the compute, with chunks most of it overlaps the next chunk."""
    import os

    from services.decode.service import DecodeService, DecodeSettings
    from services.engine_args import PREFILL_CHUNK_TOKENS
    from shared import bus, subjects
    from shared.protocol.events import LoadBeat
    from shared.protocol.generate import GenerateRequest, TokenChunk
    from shared.sampling_params import SamplingParams

    chunk = PREFILL_CHUNK_TOKENS if args.prefill_chunk_tokens is None else args.prefill_chunk_tokens
    cfg = dataclasses.replace(_engine_config(model, args), tensor_parallel_size=args.decode_tp)
    decode = DecodeService(cfg, DecodeSettings("d-tp", remote_prefill_threshold=0, use_kvstore=False,
                                               remote_prefill_timeout_s=300))
    modes = ("via_rank0", "rank_to_rank")
    results: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-nats-") as tmp, NatsServer(workdir=tmp) as nats:
        threads = max(1, torch.get_num_threads() // 2)  # the two workers share the cores
        prefill = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.prefill", "--nats-url", nats.url, "--model", model, "--dtype", "float32",
            "--kv-cache-bytes", str(args.kv_cache_bytes), "--no-kvstore", "--worker-id", "p-tp",
            "--long-prefill-token-threshold", str(chunk), "--tensor-parallel-size", str(args.prefill_tp),
            "--threads", str(threads), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            nc = await bus.connect(nats.url)
            torch.set_num_threads(threads)
            await decode.start(await bus.connect(nats.url))
            by_rank = list(decode.kv_rank_endpoints)
            assert by_rank, "the decode worker opened no rank-to-rank receivers"
            for _ in range(600):  # the prefill worker loads its ranks meanwhile
                try:
                    await nc.request(f"$SRV.PING.{subjects.SERVICE_PREFILL}", b"", timeout=0.5)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    await asyncio.sleep(0.5)
            vocab = decode.engine.model_config.vocab_size
            params = SamplingParams(max_tokens=1, temperature=0.0)
            # The prefill worker's beats carry its cumulative KV handout (inside its engine steps: gathering
            # whole blocks, or the ranks sending their heads) and push wait (after the last piece until decode
            # had every block): per request, the KV path's own seconds, which the TTFT's compute noise hides.
            beats: list[LoadBeat] = []

            async def on_beat(beat: LoadBeat, ctx) -> None:  # noqa: ANN001
                beats.append(beat)

            sub = await bus.subscribe(nc, subjects.prefill_load("p-tp"), on_beat, LoadBeat)
            kv_s: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            pushes = 0
            for i in range(args.repeats + 1):  # the first round warms up
                for mode in (modes if i % 2 else modes[::-1]):
                    decode.kv_rank_endpoints = by_rank if mode == "rank_to_rank" else []
                    req = GenerateRequest(request_id=uuid.uuid4().hex, sampling=params,
                                          prompt_token_ids=random_tokens(rng, args.prompt_len, vocab))
                    before = beats[-1] if beats else None
                    t0 = time.perf_counter()
                    async with await bus.request_stream(nc, subjects.decode_generate("d-tp"), req, timeout=300,
                                                        expect=TokenChunk) as stream:
                        async for _ in stream:
                            break
                    ttft = time.perf_counter() - t0
                    pushes += 1
                    for _ in range(100):  # until a beat counts this push
                        if beats and beats[-1].kv_pushes >= pushes:
                            break
                        await asyncio.sleep(0.05)
                    after = beats[-1]
                    if i:
                        results[mode].append(ttft)
                        kv_s[mode].append({
                            "handout_s": after.kv_handout_seconds - (before.kv_handout_seconds if before else 0.0),
                            "push_wait_s": after.kv_push_wait_seconds - (before.kv_push_wait_seconds if before else 0.0)})
            await sub.unsubscribe()
            writes = await decode.thread.call(lambda e: (e.runner.shard_writes, e.runner.whole_writes))
            remote, fallbacks = decode.remote_prefills, decode.remote_fallbacks
            await decode.drain(5)
            await nc.drain()
        finally:
            prefill.terminate()
            await prefill.wait()
    assert fallbacks == 0, f"{fallbacks} remote prefills fell back to a local prefill"
    med = {m: statistics.median(ts) for m, ts in results.items()}
    kv_ms = {m: {k: 1e3 * statistics.median(r[k] for r in runs) for k in ("handout_s", "push_wait_s")}
             for m, runs in kv_s.items()}
    return {"ttft_remote_via_rank0_s": med["via_rank0"], "ttft_remote_rank_to_rank_s": med["rank_to_rank"],
            "rank_to_rank_saves_ms": 1e3 * (med["via_rank0"] - med["rank_to_rank"]),
            "kv_path_ms": {m: {"handout_ms": v["handout_s"], "push_wait_ms": v["push_wait_s"],
                               "total_ms": v["handout_s"] + v["push_wait_s"]} for m, v in kv_ms.items()},
            "kv_runs": kv_s,
            "prefill_chunk_tokens": chunk, "remote_prefills": remote, "decode_rank0_shard_writes": writes[0],
            "decode_rank0_whole_writes": writes[1], "runs": results}


def run(args: argparse.Namespace) -> int:
    warn_if_busy()
    rng = random.Random(args.seed)
    if args.decode_tp > 1 and args.prefill_tp > 1:
        with model_dir(args) as model:
            print(f"TTFT with a TP={args.prefill_tp} prefill worker (own process) and a TP={args.decode_tp} decode "
                  "worker: KV through rank 0 vs rank to rank ...", file=sys.stderr)
            ttft = asyncio.run(measure_ttft_both_tp(model, args, rng))
            result = {"prompt_len": args.prompt_len, "model": read_shape(model), "ttft": ttft,
                      "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "machine": machine_info("cpu"),
                      "torch_threads": torch.get_num_threads()}
        print(f"TTFT {args.prompt_len}-token prompt, remote prefill TP={args.prefill_tp} -> decode "
              f"TP={args.decode_tp}: KV via rank 0 {ttft['ttft_remote_via_rank0_s']:.3f} s, rank to rank "
              f"{ttft['ttft_remote_rank_to_rank_s']:.3f} s (saves {ttft['rank_to_rank_saves_ms']:.1f} ms)")
        for mode, v in ttft["kv_path_ms"].items():
            print(f"  KV path {mode:>12}: handout in the prefill engine {v['handout_ms']:.1f} ms + push wait "
                  f"{v['push_wait_ms']:.1f} ms = {v['total_ms']:.1f} ms a request (medians)")
        write_result(args.json, result)
        return 0
    with model_dir(args) as model:
        print("KV transfer over NATS, TCP and shared memory ...", file=sys.stderr)
        transfer = asyncio.run(measure_transfer(model, args, rng))
        print("time to first token: local, remote, kvstore ...", file=sys.stderr)
        ttft = asyncio.run(measure_ttft(model, args, rng))
        result = {"prompt_len": args.prompt_len, "model": read_shape(model), "transfer": transfer, "ttft": ttft,
                  "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
                  "machine": machine_info("cpu"), "torch_threads": torch.get_num_threads()}
    for path, t in transfer["paths"].items():
        print(f"KV transfer {path:>4}  {t['bytes'] / 1e6:8.1f} MB ({t['blocks']} blocks) in {t['seconds']:.3f} s = "
              f"{t['gb_per_s']:.2f} GB/s; in-memory copy {t['memcpy_seconds'] * 1e3:.1f} ms = "
              f"{t['memcpy_gb_per_s']:.1f} GB/s (path/copy {t['ratio_to_memcpy']:.2f})")
    print(f"TTFT {args.prompt_len}-token prompt: local {ttft['ttft_local_s']:.3f} s, remote "
          f"{ttft['ttft_remote_s']:.3f} s, prefix from kvstore {ttft['ttft_kvstore_s']:.3f} s "
          f"(cached tokens {ttft['kvstore_cached_tokens']})")
    print(f"remote prefill in {ttft['prefill_chunk_tokens'] or args.prompt_len}-token chunks: decode waited "
          f"{ttft['push_wait_ms_mean']:.1f} ms on average for KV after the last chunk computed")
    write_result(args.json, result)
    return 0
