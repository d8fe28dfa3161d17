"""The NATS bus against a real nats-server: request/reply, chunking, streaming, hostility, traces."""
from __future__ import annotations

import asyncio
import json
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgpack
import nats
import pytest
from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects, wire
from shared import protocol as p
from shared.bus import headers as H
from shared.bus.chunks import frames
from shared.telemetry import attach_memory_exporter
from tests.nats_fixtures import nats_server, nats_server_factory  # noqa: F401  (fixtures)

T = TypeVar("T")
ENCODE = subjects.TOKENIZER_ENCODE


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def echo_encode(req: p.EncodeRequest, ctx: bus.RequestContext) -> p.EncodeReply:
    if req.prompt == "fail":
        raise RuntimeError("handler exploded")
    if req.prompt == "refuse":
        raise bus.RemoteError("overloaded", "come back later")
    if req.prompt == "error-reply":
        return p.ErrorReply(code="not_found", message="no such thing")  # type: ignore[return-value]
    if req.prompt == "slow":
        await asyncio.sleep(2)
    return p.EncodeReply(token_ids=req.token_ids if req.token_ids is not None else [len(req.prompt or "")])


async def with_server(url: str, body: Callable[[Client], Awaitable[T]], handler: Any = echo_encode) -> T:
    nc = await bus.connect(url)
    served = await bus.serve(nc, ENCODE, subjects.QUEUE_TOKENIZER, handler, p.EncodeRequest)
    try:
        return await body(nc)
    finally:
        await served.stop()
        await nc.close()


def test_request_reply(nats_server: str) -> None:
    async def body(nc: Client) -> None:
        reply = await bus.request(nc, ENCODE, p.EncodeRequest(prompt="hello"), expect=p.EncodeReply)
        assert reply == p.EncodeReply(token_ids=[5])
        # a second client, the way another service would call
        other = await bus.connect(nats_server)
        try:
            replies = await asyncio.gather(*(bus.request(other, ENCODE, p.EncodeRequest(token_ids=[i])) for i in range(20)))
            assert [r.token_ids for r in replies] == [[i] for i in range(20)]
        finally:
            await other.close()

    run(with_server(nats_server, body))


def test_connect_reads_nats_url(nats_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", nats_server)

    async def body() -> None:
        nc = await bus.connect()
        assert nc.is_connected and nc.max_payload == 1 << 20
        await nc.close()

    run(body())


def test_no_responders_is_immediate(nats_server_factory: Callable[..., str]) -> None:
    url = nats_server_factory(max_payload=64 * 1024)

    async def body() -> None:
        nc = await bus.connect(url)
        try:
            for msg in (p.EncodeRequest(prompt="x"), p.EncodeRequest(token_ids=list(range(100_000)))):  # plain, upload
                t0 = time.perf_counter()
                with pytest.raises(bus.NoRespondersError, match="kvmesh.tokenizer.encode"):
                    await bus.request(nc, ENCODE, msg, timeout=10)
                assert time.perf_counter() - t0 < 0.5
            t0 = time.perf_counter()
            with pytest.raises(bus.NoRespondersError):
                stream = await bus.request_stream(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="r", prompt_token_ids=[1]), timeout=10)
                async for _ in stream:
                    pass
            assert time.perf_counter() - t0 < 0.5
        finally:
            await nc.close()

    run(body())


def test_errors_timeouts_and_remote_errors(nats_server: str) -> None:
    async def body(nc: Client) -> None:
        with pytest.raises(bus.RemoteError) as e:
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="fail"))
        assert e.value.code == "internal" and "handler exploded" in e.value.message
        with pytest.raises(bus.RemoteError) as e:
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="refuse"))
        assert e.value.code == "overloaded"
        with pytest.raises(bus.RemoteError) as e:
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="error-reply"))
        assert e.value.code == "not_found"
        t0 = time.perf_counter()
        with pytest.raises(bus.BusTimeout):
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="slow"), timeout=0.3)
        assert time.perf_counter() - t0 < 1.5
        with pytest.raises(wire.WireError, match="unexpected message kind"):
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="x"), expect=p.DecodeReply)
        assert (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="ok"))).token_ids == [2]

    run(with_server(nats_server, body))


def test_chunked_request_and_reply(nats_server_factory: Callable[..., str]) -> None:
    url = nats_server_factory(max_payload=64 * 1024)
    blob = bytes(range(256)) * (3 * 4096)  # 3 MiB

    async def store(req: p.PutRequest, ctx: bus.RequestContext) -> p.GetReply:
        return p.GetReply(blocks=req.blocks[::-1])

    async def body() -> None:
        nc = await bus.connect(url)
        served = await bus.serve(nc, subjects.KVSTORE_PUT, subjects.QUEUE_KVSTORE, store, p.PutRequest)
        try:
            assert nc.max_payload == 64 * 1024
            blocks = [
                p.StoredBlock(hash=bytes([i]), k=wire.WireTensor(dtype="uint8", shape=[len(blob) // 2], data=blob[: len(blob) // 2]),
                              v=wire.WireTensor(dtype="uint8", shape=[len(blob) // 2], data=blob[len(blob) // 2 :]))
                for i in range(1)
            ] + [p.StoredBlock(hash=b"\x09", k=wire.WireTensor(dtype="uint8", shape=[1], data=b"k"), v=wire.WireTensor(dtype="uint8", shape=[0], data=b""))]  # fmt: skip
            req = p.PutRequest(blocks=blocks)
            assert len(wire.encode(req)) > 3_000_000
            reply = await bus.request(nc, subjects.KVSTORE_PUT, req, timeout=10, expect=p.GetReply)
            assert reply.blocks == blocks[::-1]
            assert nc.is_connected  # no max_payload violation closed the connection
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_long_prompt_with_default_max_payload(nats_server: str) -> None:
    prompt = [65_536 + (i * 7919) % 85_000 for i in range(256_000)]  # 5 msgpack bytes each: ~1.3 MB

    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> p.EncodeReply:
        return p.EncodeReply(token_ids=req.prompt_token_ids)

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        try:
            req = p.GenerateRequest(request_id="long", prompt_token_ids=prompt)
            assert len(wire.encode(req)) > nc.max_payload
            reply = await bus.request(nc, subjects.DECODE_GENERATE, req, timeout=10, expect=p.EncodeReply)
            assert reply.token_ids == prompt
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_headers_count_against_max_payload(nats_server_factory: Callable[..., str]) -> None:
    """A payload just under max_payload plus headers must be chunked, not kill the connection."""
    url = nats_server_factory(max_payload=64 * 1024)

    async def body() -> None:
        nc = await bus.connect(url)
        try:
            sub = await nc.subscribe("kvmesh.test.edge")
            hdrs = H.with_trace({H.SEQ: "0", "X-Pad": "p" * 200})
            data = b"\x01" * (nc.max_payload - 10)
            parts = frames(nc.max_payload, data, hdrs)
            assert len(parts) == 2
            assert all(len(d) + H.header_bytes(h) <= nc.max_payload for d, h in parts)
            await bus.chunks.send_direct(nc, "kvmesh.test.edge", data, hdrs)
            assembler = bus.Reassembler()
            env = None
            while env is None:
                env = assembler.feed(await sub.next_msg(timeout=5))
            assert env.data == data and env.headers == hdrs
            assert nc.is_connected
        finally:
            await nc.close()

    run(body())


def test_stream_order_1000_with_chunked_items(nats_server_factory: Callable[..., str]) -> None:
    url = nats_server_factory(max_payload=64 * 1024)
    big = list(range(40_000))  # ~120 KB: every 100th item is chunked

    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> AsyncIterator[p.TokenChunk]:
        for i in range(1000):
            ids = big if i % 100 == 0 else [i]
            yield p.TokenChunk(request_id=req.request_id, seq=i, token_ids=ids, finish_reason="length" if i == 999 else None)

    async def body() -> None:
        nc = await bus.connect(url)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        try:
            req = p.GenerateRequest(request_id="s1", prompt_token_ids=[1, 2])
            seen = []
            async with await bus.request_stream(nc, subjects.DECODE_GENERATE, req, expect=p.TokenChunk, timeout=10) as stream:
                async for chunk in stream:
                    assert chunk.token_ids == (big if chunk.seq % 100 == 0 else [chunk.seq])
                    seen.append(chunk.seq)
            assert seen == list(range(1000))
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_stream_ends_with_remote_error_and_early_exit(nats_server: str) -> None:
    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> AsyncIterator[p.TokenChunk]:
        for i in range(3):
            yield p.TokenChunk(request_id=req.request_id, seq=i, token_ids=[i])
        if req.request_id == "boom":
            raise RuntimeError("GPU on fire")
        # a handler can also keep streaming from elsewhere: here, the caller leaves early
        for i in range(3, 10_000):
            yield p.TokenChunk(request_id=req.request_id, seq=i, token_ids=[i])
            await asyncio.sleep(0)

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        try:
            got = []
            with pytest.raises(bus.RemoteError, match="GPU on fire"):
                stream = await bus.request_stream(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="boom", prompt_token_ids=[1]))
                async for chunk in stream:
                    got.append(chunk.seq)
            assert got == [0, 1, 2]
            async with await bus.request_stream(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="x", prompt_token_ids=[1])) as stream:
                async for chunk in stream:
                    if chunk.seq == 5:
                        break
            assert (await bus.request(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="boom", prompt_token_ids=[1]))).seq == 0
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_stream_reply_from_another_task(nats_server: str) -> None:
    """The decode pattern: the handler registers ctx.stream() and returns; an engine loop feeds it."""
    queue: asyncio.Queue[bus.StreamReply] = asyncio.Queue()

    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> None:
        await queue.put(ctx.stream())

    async def engine_loop() -> None:
        out = await queue.get()
        for i in range(5):
            await out.send(p.TokenChunk(request_id="r", seq=i, token_ids=[i]))
        await out.end()
        await out.end()  # idempotent

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        loop_task = asyncio.create_task(engine_loop())
        try:
            stream = await bus.request_stream(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="r", prompt_token_ids=[1]))
            assert [c.seq async for c in stream] == [0, 1, 2, 3, 4]
            await loop_task
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_stream_ready_and_watch(nats_server: str) -> None:
    """`ready`: items that arrived together can be read without a wait (the gateway writes them in one go);
    `watch`: the check runs while the stream waits, in the waiting task, and what it raises ends the stream."""
    queue: asyncio.Queue[bus.StreamReply] = asyncio.Queue()

    class Gone(Exception):
        pass

    async def generate(req: p.GenerateRequest, ctx: bus.RequestContext) -> None:
        await queue.put(ctx.stream())

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, generate, p.GenerateRequest)
        try:
            stream = await bus.request_stream(nc, subjects.DECODE_GENERATE, p.GenerateRequest(request_id="r", prompt_token_ids=[1]),
                                              expect=p.TokenChunk)
            checks: list[float] = []

            def check() -> None:
                checks.append(time.monotonic())
                if len(checks) == 3:
                    raise Gone()

            stream.watch(check, 0.05)
            out = await queue.get()
            assert not stream.ready
            for i in range(3):
                await out.send(p.TokenChunk(request_id="r", seq=i, token_ids=[i]))
            for _ in range(100):
                if stream.ready:
                    break
                await asyncio.sleep(0.01)
            seen = []
            while stream.ready:  # all three arrived: each read takes what is there
                seen.append((await stream.__anext__()).seq)
            assert seen == [0, 1, 2] and not checks  # no wait, so no check
            t0 = time.monotonic()
            with pytest.raises(Gone):
                await stream.__anext__()  # nothing comes: the check runs every 0.05 s until it raises
            assert len(checks) == 3 and 0.1 <= time.monotonic() - t0 < 2
            assert not stream.ready
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_hostile_messages_do_not_stop_the_server(nats_server: str) -> None:
    async def body(nc: Client) -> None:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        hostile: list[tuple[bytes, dict[str, str] | None]] = [
            (pickle.dumps({"kind": "tokenizer.encode", "prompt": "x"}), None),
            (b"\xc1\xc1\xc1", None),
            (msgpack.packb({"kind": "tokenizer.encode", "version": 1, "prompt": msgpack.ExtType(1, b"x")}), None),
            (msgpack.packb({"kind": "tokenizer.encode", "version": 99, "prompt": "x"}), None),
            (msgpack.packb({"kind": "decode.cancel", "version": 1, "request_id": "r"}), None),  # wrong kind here
            (b"x", {H.CHUNK: "0/999999999", H.MSG_ID: "m", H.SIZE: "999999999999"}),
            (b"x", {H.CHUNK: "banana", H.MSG_ID: "m", H.SIZE: "1"}),
            (b"x", {H.CHUNK: "0/2", H.MSG_ID: "m", H.SIZE: "2", H.UPLOAD: "1", H.REPLY: "bad subject with spaces"}),
        ]
        for data, hdrs in hostile:
            await nc.publish(ENCODE, data, reply=inbox, headers=hdrs)
            await nc.publish(ENCODE, data, headers=hdrs)  # and without a reply subject
        errors, handshakes = [], 0
        while len(errors) < 5 or handshakes < 1:  # five undecodable bodies answered, one upload acknowledged
            msg = await sub.next_msg(timeout=5)
            if H.UPLOAD in (msg.headers or {}):
                handshakes += 1
            else:
                errors.append(wire.decode(msg.data, p.ErrorReply))
        assert {e.code for e in errors} == {"bad_request"}
        assert any("Ext" in e.message or "extension" in e.message for e in errors)
        reply = await bus.request(nc, ENCODE, p.EncodeRequest(prompt="still alive"))
        assert reply.token_ids == [11]

    run(with_server(nats_server, body))


def test_upload_that_never_completes_is_dropped(nats_server: str) -> None:
    limits = bus.BusLimits(reassembly_timeout=0.3)

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = await bus.serve(nc, ENCODE, subjects.QUEUE_TOKENIZER, echo_encode, p.EncodeRequest, limits=limits)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            ack = await nc.request(ENCODE, b"x", timeout=2, headers={H.CHUNK: "0/2", H.MSG_ID: "m", H.SIZE: "2", H.UPLOAD: "1", H.REPLY: inbox})
            assert ack.headers[H.UPLOAD]  # handshake answered; we never send chunk 1
            # The error goes to no subject a header names (only NATS replies are answered: shared/bus/chunks.py).
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=1)
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="ok"))).token_ids == [2]
        finally:
            await served.stop()
            await nc.close()

    run(body())


def test_trace_context_propagates(nats_server: str) -> None:
    exporter = attach_memory_exporter()
    seen: dict[str, int] = {}

    async def handler(req: p.EncodeRequest, ctx: bus.RequestContext) -> p.EncodeReply:
        seen["trace_id"] = trace.get_current_span().get_span_context().trace_id
        assert "traceparent" in ctx.headers
        return p.EncodeReply(token_ids=[1])

    async def body(nc: Client) -> int:
        tracer = trace.get_tracer("test")
        with tracer.start_as_current_span("http request") as root:
            await bus.request(nc, ENCODE, p.EncodeRequest(prompt="traced"))
            return root.get_span_context().trace_id

    trace_id = run(with_server(nats_server, body, handler))
    assert seen["trace_id"] == trace_id
    spans = {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}
    assert {"http request", f"request {ENCODE}", f"serve {ENCODE}"} <= set(spans)
    assert spans[f"serve {ENCODE}"].parent.span_id == spans[f"request {ENCODE}"].context.span_id
    assert spans[f"request {ENCODE}"].parent.span_id == spans["http request"].context.span_id


def test_fanout_spans_only_for_traced_messages(nats_server: str) -> None:
    """A cancel sent inside a request's trace is handled in a consumer span of that trace; a load beat (no trace
    context) makes no trace of its own; traced=False subscriptions (the gateway's beats) make none at all."""
    exporter = attach_memory_exporter()
    subject = "kvmesh.test.fanout-spans"
    quiet = "kvmesh.test.fanout-quiet"

    async def body() -> int:
        nc = await bus.connect(nats_server)
        got: list[str] = []

        async def on_msg(ev: p.CancelRequest, ctx: bus.RequestContext) -> None:
            got.append(ev.request_id)

        subs = [await bus.subscribe(nc, subject, on_msg, p.CancelRequest),
                await bus.subscribe(nc, quiet, on_msg, p.CancelRequest, traced=False)]
        try:
            await bus.publish(nc, subject, p.CancelRequest(request_id="untraced", reason="x"))
            with trace.get_tracer("test").start_as_current_span("http request") as root:
                await bus.publish(nc, subject, p.CancelRequest(request_id="traced", reason="x"))
                await bus.publish(nc, quiet, p.CancelRequest(request_id="quiet", reason="x"))
            await nc.flush()
            for _ in range(100):
                if len(got) == 3:
                    break
                await asyncio.sleep(0.02)
            assert sorted(got) == ["quiet", "traced", "untraced"]
            return root.get_span_context().trace_id
        finally:
            for sub in subs:
                await sub.unsubscribe()
            await nc.close()

    trace_id = run(body())
    receives = [s for s in exporter.get_finished_spans() if s.name.startswith("receive kvmesh.test.fanout")]
    assert [s.name for s in receives] == [f"receive {subject}"]
    assert receives[0].context.trace_id == trace_id and receives[0].parent is not None


def test_micro_discovery_and_endpoints(nats_server_factory: Callable[..., str]) -> None:
    url = nats_server_factory(max_payload=64 * 1024)

    async def body() -> None:
        nc = await bus.connect(url)
        svc = await bus.add_micro_service(
            nc, subjects.SERVICE_TOKENIZER, "0.1.0",
            [bus.Endpoint("encode", ENCODE, subjects.QUEUE_TOKENIZER, echo_encode, p.EncodeRequest)],
            description="tokenizer",
        )  # fmt: skip
        try:
            ping = json.loads((await nc.request("$SRV.PING", b"", timeout=2)).data)
            assert ping["name"] == subjects.SERVICE_TOKENIZER and ping["id"] == svc.id
            info = json.loads((await nc.request(f"$SRV.INFO.{subjects.SERVICE_TOKENIZER}", b"", timeout=2)).data)
            assert [(e["subject"], e["queue_group"]) for e in info["endpoints"]] == [(ENCODE, subjects.QUEUE_TOKENIZER)]
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="abc"))).token_ids == [3]
            big = list(range(50_000))  # chunked upload through the micro endpoint
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(token_ids=big))).token_ids == big
            stats = json.loads((await nc.request(f"$SRV.STATS.{subjects.SERVICE_TOKENIZER}", b"", timeout=2)).data)
            assert stats["endpoints"][0]["num_requests"] >= 2
        finally:
            await svc.stop()
            await nc.close()

    run(body())


def test_fanout_events_in_order(nats_server_factory: Callable[..., str]) -> None:
    url = nats_server_factory(max_payload=64 * 1024)

    async def body() -> None:
        nc = await bus.connect(url)
        got: dict[str, list[int]] = {"a": [], "b": []}
        subs = []
        for name in got:
            async def on_event(ev: p.BlockStored | p.BlockRemoved, ctx: bus.RequestContext, name: str = name) -> None:
                assert subjects.worker_from_subject(ctx.subject) == "d0"
                got[name].append(len(ev.hashes))

            subs.append(await bus.subscribe(nc, subjects.DECODE_EVENTS_ALL, on_event, (p.BlockStored, p.BlockRemoved)))
        try:
            for n in (1, 5000, 2, 3):  # 5000 16-byte hashes: chunked
                await bus.publish(nc, subjects.decode_events("d0"), p.BlockStored(worker_id="d0", hashes=[b"h" * 16] * n))
            await nc.publish(subjects.decode_events("d0"), b"garbage")  # logged and skipped
            await bus.publish(nc, subjects.decode_events("d0"), p.BlockRemoved(worker_id="d0", hashes=[b"h" * 16]))
            await nc.flush()
            for _ in range(100):
                if all(len(v) == 5 for v in got.values()):
                    break
                await asyncio.sleep(0.02)
            assert got == {"a": [1, 5000, 2, 3, 1], "b": [1, 5000, 2, 3, 1]}
        finally:
            await nc.close()

    run(body())


def test_reassembler_limits() -> None:
    from nats.aio.msg import Msg

    def chunk(i: int, n: int, size: int, data: bytes, msg_id: str = "m") -> Msg:
        return Msg(_client=None, subject="s", data=data, headers={H.CHUNK: f"{i}/{n}", H.MSG_ID: msg_id, H.SIZE: str(size)})  # type: ignore[arg-type]

    now = [0.0]
    r = bus.Reassembler(bus.BusLimits(max_message_bytes=10, max_pending_bytes=15, reassembly_timeout=5), clock=lambda: now[0])
    assert r.feed(chunk(0, 2, 4, b"ab")) is None
    env = r.feed(chunk(1, 2, 4, b"cd"))
    assert env is not None and env.data == b"abcd" and H.CHUNK not in env.headers
    with pytest.raises(bus.ChunkError, match="exceeds"):
        r.feed(chunk(0, 2, 11, b"ab"))
    with pytest.raises(bus.ChunkError, match="unknown message"):
        r.feed(chunk(1, 2, 4, b"ab", "other"))
    r.feed(chunk(0, 3, 6, b"ab"))
    with pytest.raises(bus.ChunkError, match="out of order"):
        r.feed(chunk(2, 3, 6, b"ef"))
    r.feed(chunk(0, 2, 4, b"ab", "x"))
    with pytest.raises(bus.ChunkError, match="received"):
        r.feed(chunk(1, 2, 4, b"cdef", "x"))
    # Partial messages hold the bytes they sent, not the sizes they announced.
    r.feed(chunk(0, 2, 10, b"abcdefgh", "p1"))
    assert r.feed(chunk(0, 2, 10, b"ab", "p0")) is None and r.pending_bytes == 10
    with pytest.raises(bus.ChunkError, match="partially received"):
        r.feed(chunk(0, 2, 10, b"abcdefgh", "p2"))
    now[0] = 6.0  # p1 and p0 expire
    assert r.feed(chunk(0, 2, 10, b"abcdefgh", "p2")) is None and r.pending_bytes == 8


def test_subjects() -> None:
    assert subjects.decode_kv_push("w-1") == "kvmesh.decode.kv.push.w-1"
    assert subjects.decode_load("w_2") == "kvmesh.decode.load.w_2"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError):
            subjects.decode_events(bad)
    names = [v for k, v in vars(subjects).items() if k.isupper() and isinstance(v, str) and v.startswith("kvmesh.")]
    assert len(names) == len(set(names))


def test_one_memory_cap_across_all_uploads_of_a_connection(nats_server: str) -> None:
    """Uploads on two subjects together may not hold more than max_pending_bytes of what they sent (not of
    what they announced): the one over it is refused at once, the others go on, and released room serves
    the next upload."""
    # (one sender may hold the whole budget here: the per-sender share is tests/test_security_upload_sender.py's)
    limits = bus.BusLimits(max_message_bytes=1000, max_pending_bytes=1500, max_sender_bytes=1500, reassembly_timeout=2)
    other = ENCODE + ".other"

    async def body() -> None:
        nc = await bus.connect(nats_server)
        served = [await bus.serve(nc, ENCODE, subjects.QUEUE_TOKENIZER, echo_encode, p.EncodeRequest, limits=limits),
                  await bus.serve(nc, other, subjects.QUEUE_TOKENIZER, echo_encode, p.EncodeRequest, limits=limits)]
        try:
            async def start_upload(subject: str, msg_id: str, first_chunk: bytes) -> tuple[str, bytes]:
                ack = await nc.request(subject, first_chunk, timeout=2, headers={
                    H.CHUNK: "0/2", H.MSG_ID: msg_id, H.SIZE: "900", H.UPLOAD: "1"})
                return (ack.headers or {}).get(H.UPLOAD, ""), ack.data
            for i in range(3):  # announced 2,700 bytes, sent 3: nothing much held
                assert (await start_upload(ENCODE, f"small{i}", b"x"))[0]
            first, _ = await start_upload(ENCODE, "a", b"x" * 800)  # 800 of 1500 bytes held, never completed
            assert first
            second, answer = await start_upload(other, "b", b"x" * 800)  # another subject: 800 more pass the cap
            assert not second
            assert "over the 1500-byte limit" in wire.decode(answer, p.ErrorReply).message
            await asyncio.sleep(2.5)  # the first upload times out and gives its room back
            third, _ = await start_upload(other, "c", b"x" * 800)
            assert third
        finally:
            for s in served:
                await s.stop()
            await nc.close()

    run(body())
