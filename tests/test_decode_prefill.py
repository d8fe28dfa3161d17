"""Decode and prefill services on a real nats-server: remote prefill, KV transfer, kvstore reuse,
fallbacks and cancellation, compared with transformers token for token."""
from __future__ import annotations

import asyncio
import socket

import pytest

from shared import bus, subjects
from shared.kv_transport.direct import DirectSettings
from shared.protocol import errors as codes
from shared.protocol.generate import CancelRequest, GenerateRequest, TokenChunk
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import (decode_service, generate, kvstore_service, prefill_service, running, wait_idle)
from tests.nats_fixtures import nats_server  # noqa: F401

MAX_NEW = 10


def check(ckpt, hf_reference, prompt, tokens):
    ref, _ = hf_reference(ckpt, prompt, MAX_NEW)
    assert tokens == ref


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "nats"])
def test_remote_prefill_forced_matches_transformers(nats_server, checkpoints, hf_reference, direct):
    ckpt = checkpoints["qwen2"]
    prompts = random_prompts([3, 16, 40, 90, 17], seed=21)
    # Prompts past 32 tokens prefill in 32-token chunks, whose blocks are pushed while the next chunk
    # computes (40: one piece before the last blocks, 90: two); over NATS they go together at the end.
    decode = decode_service(ckpt, threshold=0, direct_kv=direct)
    prefill = prefill_service(ckpt, long_prefill_token_threshold=32)

    async def main():
        async with running(nats_server, kvstore_service(), prefill, decode) as nc:
            results = await asyncio.gather(*(generate(nc, p, greedy(MAX_NEW, None), f"r{i}")
                                             for i, p in enumerate(prompts)))
            for p, (tokens, chunks) in zip(prompts, results):
                check(ckpt, hf_reference, p, tokens)
                assert [c.seq for c in chunks] == list(range(len(chunks)))
            await wait_idle(decode, prefill)
            assert (decode.remote_prefills, decode.remote_fallbacks) == (len(prompts), 0)
            assert prefill.kv_pieces == 3
            if not direct:
                assert prefill.transport.direct_sends == 0 and decode.transport.endpoint is None
                return
            # The KV went over the direct channel (shared memory: one host), not over NATS.
            assert prefill.transport.direct_sends == decode.remote_prefills and prefill.transport.fallbacks == 0
            assert decode.transport.server.shm_frames == decode.transport.server.frames > 0
            beat = await decode._load_snapshot()  # the endpoint is advertised in beats and nats.micro info too
            assert beat.kv_endpoint == decode.transport.endpoint and beat.kv_endpoint.startswith("tcp://")

    asyncio.run(main())


@pytest.mark.parametrize("chunk", [0, 32], ids=["whole", "pieces"])
def test_a_direct_transfer_cut_off_halfway_recomputes_locally(nats_server, checkpoints, hf_reference, chunk):
    """The decode side drops the direct connection after the first frame of the first transfer: that
    request is prefilled locally (same tokens), every reserved block is freed, and the next transfer
    opens a new connection. With chunk 32 the cut falls in a piece pushed while the prompt still
    computes: the pieces after it are not sent."""
    ckpt = checkpoints["llama"]
    prompts = random_prompts([90, 70], seed=25)
    decode = decode_service(ckpt, threshold=0, transfer_timeout=3.0)
    prefill = prefill_service(ckpt, long_prefill_token_threshold=chunk)

    async def main():
        async with running(nats_server, prefill, decode) as nc:
            prefill.transport.sender.settings = DirectSettings(frame_bytes=4096, slots=2)  # many frames
            server, frames = decode.transport.server, [0]
            place = server._frame

            async def cut(h, payload, sock, lock):  # noqa: ANN001, ANN202
                frames[0] += 1
                if frames[0] == 2:
                    sock.shutdown(socket.SHUT_RDWR)  # the connection breaks with the transfer half done
                    return
                await place(h, payload, sock, lock)

            server._frame = cut
            for i, p in enumerate(prompts):
                tokens, _ = await asyncio.wait_for(generate(nc, p, greedy(MAX_NEW, None), f"cut{i}"), 20)
                check(ckpt, hf_reference, p, tokens)
            assert (decode.remote_prefills, decode.remote_fallbacks) == (1, 1)
            assert frames[0] > 3, (frames, prefill.transport.direct_sends, prefill.transport.fallbacks)
            assert prefill.kv_pieces == (4 if chunk else 0)  # 90 tokens: 2 pieces sent or not, 70: 2
            await wait_idle(decode, prefill)

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


def test_cached_prefix_is_admitted_in_one_engine_command(nats_server, checkpoints, hf_reference):
    """With a kvstore below it, a decode worker admits a prompt whose every full block is in its device cache with
    one engine command (Reserve commits it: the kvstore has nothing to add), not Reserve then Commit, each of
    which waits for a step boundary; a prompt with uncached blocks still asks the kvstore first."""
    from shared.engine.commands import Commit, Reserve

    ckpt = checkpoints["llama"]
    prompt = random_prompts([40], seed=31)[0]  # two full blocks, then 8 tokens
    decode = decode_service(ckpt, threshold=10_000)
    store = kvstore_service()

    async def main():
        async with running(nats_server, store, decode) as nc:
            ran: list[str] = []
            run = decode.thread.run

            async def recording(command):
                ran.append(type(command).__name__)
                return await run(command)
            decode.thread.run = recording
            tokens, _ = await generate(nc, prompt, greedy(MAX_NEW, None), "first")
            check(ckpt, hf_reference, prompt, tokens)
            admitted = [c for c in ran if c in (Reserve.__name__, Commit.__name__)]
            assert admitted == ["Reserve", "Commit"]  # new blocks: the kvstore was asked in between
            ran.clear()
            again, chunks = await generate(nc, prompt, greedy(MAX_NEW, None), "again")
            assert again == tokens and chunks[0].num_cached_tokens == 32
            assert [c for c in ran if c in (Reserve.__name__, Commit.__name__)] == ["Reserve"]
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


@pytest.mark.parametrize("policy", ["eviction", "write-through"])
def test_second_worker_gets_prefix_from_kvstore(nats_server, checkpoints, hf_reference, policy):
    """write-through: d0's first use of a prefix puts it in the kvstore. eviction: a prefix reaches the
    kvstore when d0 reuses it (a shared prefix goes at once), not before."""
    ckpt = checkpoints["qwen3"]
    shared = random_prompts([80], seed=25)[0]
    first, second = shared + [1, 2, 3], shared + [4, 5]
    # With a mesh secret, as every real mesh has: the blocks go through the kvstore with their workers' MACs.
    d0 = decode_service(ckpt, worker_id="d0", threshold=10_000, offload_policy=policy, cache_salt="mesh secret")
    d1 = decode_service(ckpt, worker_id="d1", threshold=10_000, offload_policy=policy, cache_salt="mesh secret")
    store = kvstore_service()

    async def main():
        async with running(nats_server, store, d0, d1) as nc:
            tokens, chunks = await generate(nc, first, greedy(MAX_NEW, None), "a", subjects.decode_generate("d0"))
            check(ckpt, hf_reference, first, tokens)
            assert chunks[0].num_cached_tokens == 0
            await d0.offloader.flush(5)
            if policy == "eviction":
                assert store.tier.stats().blocks == 0  # computed once, never evicted: nothing sent
                tokens, chunks = await generate(nc, shared + [6], greedy(MAX_NEW, None), "a2",
                                                subjects.decode_generate("d0"))
                assert chunks[0].num_cached_tokens == 80  # reused on d0: now a shared prefix
                await d0.offloader.flush(5)
                assert store.tier.stats().blocks == 5
            tokens, chunks = await generate(nc, second, greedy(MAX_NEW, None), "b", subjects.decode_generate("d1"))
            check(ckpt, hf_reference, second, tokens)
            assert chunks[0].num_cached_tokens == 80, "d1 never saw the prefix: it must come from the kvstore"
            assert store.tier.stats().hits > 0 and d1.kvstore.rejected == 0
            await wait_idle(d0, d1)

    asyncio.run(main())


def test_cancel_midstream_frees_everything(nats_server, checkpoints):
    ckpt = checkpoints["llama"]
    decode = decode_service(ckpt, threshold=10_000)
    prompt = random_prompts([30], seed=26)[0]

    async def main():
        async with running(nats_server, decode) as nc:
            params = greedy(400, None).model_copy(update={"ignore_eos": True})
            req = GenerateRequest(request_id="c1", prompt_token_ids=prompt, sampling=params)
            chunks = []
            # Cancelled once its first tokens arrived (not after a fixed sleep: a tiny model on the C++ CPU path
            # can finish 400 tokens in half a second).
            async with await bus.request_stream(nc, subjects.DECODE_GENERATE, req, timeout=5, expect=TokenChunk) as s:
                async for chunk in s:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        gone = CancelRequest(request_id="c1", reason="client gone")
                        await bus.publish(nc, subjects.DECODE_CANCEL, gone)
                    if chunk.finished:
                        break
            tokens = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].finish_reason == "abort" and len(tokens) < 400
            await wait_idle(decode, timeout=2.0)

    asyncio.run(main())


def test_an_admission_that_fails_unexpectedly_answers_and_frees_everything(nats_server, checkpoints, hf_reference):
    """A bug in admission (here: the kvstore lookup raising) answers the client with an internal error at once,
    frees the request's reserved blocks, and the worker keeps serving (before: the admission task died silently
    and the client waited for its timeout)."""
    ckpt = checkpoints["llama"]
    prompt = random_prompts([40], seed=33)[0]
    decode = decode_service(ckpt, threshold=10_000)
    store = kvstore_service()

    async def main():
        async with running(nats_server, store, decode) as nc:
            real = decode.load_prefix

            async def broken(rid, res):
                decode.load_prefix = real  # once
                raise RuntimeError("lookup bug")
            decode.load_prefix = broken
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(bus.RemoteError) as err:
                await generate(nc, prompt, greedy(MAX_NEW, None), "broken")
            assert err.value.code == codes.INTERNAL and "lookup bug" in err.value.message
            assert loop.time() - t0 < 5, "answered at once, not after a timeout"
            await wait_idle(decode)
            tokens, _ = await generate(nc, prompt, greedy(MAX_NEW, None), "after")
            check(ckpt, hf_reference, prompt, tokens)
            await wait_idle(decode)

    asyncio.run(main())


def test_hostile_messages_on_every_decode_and_prefill_subject(nats_server, checkpoints, hf_reference):
    from shared.protocol import RemotePrefillRequest
    from shared.protocol.generate import GenerateRequest
    from shared.protocol.kvtransfer import KVBlockChunk
    from shared.wire import tensor_to_wire
    from tests.hostile import assert_survives, hostile_bodies
    import torch

    ckpt = checkpoints["llama"]
    decode, prefill = decode_service(ckpt, threshold=0), prefill_service(ckpt)
    prompt = random_prompts([40], seed=27)[0]
    t = tensor_to_wire(torch.zeros(1, 16, 2, 16))
    samples = {
        subjects.DECODE_GENERATE: ("decode.generate", GenerateRequest(request_id="x", prompt_token_ids=[1, 2])),
        subjects.decode_generate("d0"): ("decode.generate", GenerateRequest(request_id="x", prompt_token_ids=[1])),
        subjects.decode_kv_push("d0"): ("kv.chunk", KVBlockChunk(transfer_id="t", seq=0, total=1, layer_start=0,
                                                                  layer_end=1, block_start=0, block_end=1,
                                                                  tensors=[t, t], checksum=0)),
        subjects.PREFILL_PREFILL: ("prefill.request", RemotePrefillRequest(
            request_id="x", transfer_id="t", prompt_token_ids=[1, 2], num_cached_tokens=0, decode_worker_id="d0",
            num_dest_blocks=1, block_size=16)),
    }

    async def main():
        async with running(nats_server, prefill, decode) as nc:
            for subject, (kind, valid) in samples.items():
                await assert_survives(nc, subject, hostile_bodies(kind, valid))
            for subject in (subjects.DECODE_CANCEL, subjects.PREFILL_CANCEL):  # fan-out: nobody answers
                for body in hostile_bodies("decode.cancel", CancelRequest(request_id="x")):
                    await nc.publish(subject, body)
            # A well-formed chunk for a transfer nobody expects is refused, not written anywhere.
            ack = await bus.request(nc, subjects.decode_kv_push("d0"), samples[subjects.decode_kv_push("d0")][1])
            assert not ack.ok and "unknown transfer" in ack.error
            tokens, _ = await generate(nc, prompt, greedy(MAX_NEW, None), "after")
            check(ckpt, hf_reference, prompt, tokens)
            assert decode.remote_prefills == 1
            await wait_idle(decode, prefill)

    asyncio.run(main())


def test_one_trace_covers_decode_prefill_and_kv_transfer(nats_server, checkpoints):
    from opentelemetry import trace

    from shared.telemetry import attach_memory_exporter

    exporter = attach_memory_exporter()
    ckpt = checkpoints["qwen2"]
    decode, prefill = decode_service(ckpt, threshold=0), prefill_service(ckpt)
    prompt = random_prompts([40], seed=28)[0]

    async def main():
        async with running(nats_server, prefill, decode) as nc:
            with trace.get_tracer("test").start_as_current_span("client") as root:
                await generate(nc, prompt, greedy(4, None), "traced")
            await wait_idle(decode, prefill)
            return root.get_span_context().trace_id

    trace_id = asyncio.run(main())
    names = {s.name for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}
    for expected in ("decode.request", "decode.admit", "decode.remote_prefill", "prefill.compute",
                     "kv.transfer.send", "kv.transfer.receive"):
        assert expected in names, f"{expected} missing from the request's trace: {sorted(names)}"


def test_engine_crash_fails_requests_and_ends_the_service(nats_server, checkpoints):
    ckpt = checkpoints["llama"]
    decode = decode_service(ckpt, threshold=10_000)

    async def main():
        async with running(nats_server, decode) as nc:
            def broken_step():
                raise RuntimeError("simulated kernel failure")
            decode.engine.step = broken_step
            closed = asyncio.ensure_future(decode.wait_closed())  # what the service runner watches
            tokens, chunks = await asyncio.wait_for(generate(nc, [1, 2, 3], greedy(5, None), "boom"), 10)
            assert tokens == [] and chunks[-1].finish_reason == "error"
            try:
                await asyncio.wait_for(closed, 5)
            except RuntimeError as e:
                assert "simulated kernel failure" in str(e)
            else:
                raise AssertionError("wait_closed must raise after an engine crash")

    asyncio.run(main())


def test_cancel_that_overtakes_its_request_still_cancels_it(nats_server, checkpoints):
    ckpt = checkpoints["llama"]
    decode = decode_service(ckpt, threshold=10_000)

    async def main():
        async with running(nats_server, decode) as nc:
            await bus.publish(nc, subjects.DECODE_CANCEL, CancelRequest(request_id="early", reason="client gone"))
            await nc.flush()
            await asyncio.sleep(0.2)  # the cancel is handled before the request arrives
            params = greedy(400, None).model_copy(update={"ignore_eos": True})
            tokens, chunks = await asyncio.wait_for(generate(nc, [1, 2, 3], params, "early"), 5)
            assert tokens == [] and chunks[-1].finish_reason == "abort"
            assert decode.num_received == 1
            await wait_idle(decode, timeout=1.0)
            tokens, _ = await generate(nc, [1, 2, 3], greedy(3, None), "early")  # the id is usable again
            assert len(tokens) == 3

    asyncio.run(main())


def test_prefill_workers_chunk_long_prompts_by_default(tmp_path) -> None:  # noqa: ANN001
    """The flag's default on a prefill worker (its KV goes out chunk by chunk); decode workers do not cap."""
    import argparse

    from services.decode import service as decode_cli
    from services.prefill import service as prefill_cli
    from services.engine_args import PREFILL_CHUNK_TOKENS, engine_config_from_args

    def config(cli, *argv):  # noqa: ANN001, ANN202
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return engine_config_from_args(p.parse_args(["--model", str(tmp_path), *argv]))

    assert config(prefill_cli).long_prefill_token_threshold == PREFILL_CHUNK_TOKENS == 1024
    assert config(prefill_cli, "--long-prefill-token-threshold", "0").long_prefill_token_threshold == 0
    assert config(decode_cli).long_prefill_token_threshold == 0
