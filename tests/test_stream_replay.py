"""Replays (issue 25): a decode worker keeps its recent token chunks per stream (services/decode/replay.py), so
a gateway whose NATS connection dropped and came back asks for what it lost instead of migrating the request.
The buffer's bounds as a unit; then a real mesh over a 3-server NATS cluster whose gateway loses its server
mid-stream: served from the buffer (no migration), or missed (migration, as before)."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from services.decode.replay import CHUNK_BYTES, TOKEN_BYTES, ReplayBuffer, ReplayLimits, chunk_bytes
from shared.protocol.generate import TokenChunk
from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh


def _chunk(rid: str, seq: int, n: int = 1, finish: str | None = None) -> TokenChunk:
    return TokenChunk(request_id=rid, seq=seq, token_ids=list(range(1000, 1000 + n)), finish_reason=finish)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_buffer_serves_what_it_keeps_and_misses_the_rest() -> None:
    buf = ReplayBuffer(ReplayLimits(max_chunks=4))
    for seq in range(10):
        buf.keep(_chunk("a", seq))
    assert [c.seq for c in buf.since("a", 7, 10)] == [7, 8, 9]
    assert buf.since("a", 10, 10) == []  # nothing lost yet: the stream just moves
    assert buf.since("prefilling", 0, 0) == []  # running, nothing sent yet: nothing to resend
    assert [c.seq for c in buf.since("a", 6, 10)] == [6, 7, 8, 9]  # the oldest of the 4 kept
    assert buf.since("a", 5, 10) is None  # evicted by the count bound
    assert buf.since("a", 11, 10) is None  # never sent
    assert buf.since("b", 0, None) is None  # unknown (a restarted worker)
    assert buf.since("a", 8, None) is None  # kept, but neither running nor ended (the engine failed)
    assert (buf.served, buf.missed) == (4, 4)
    # The chunks kept are the ones sent, not copies.
    c = _chunk("c", 0)
    buf.keep(c)
    assert buf.since("c", 0, 1)[0] is c


def test_the_buffer_respects_its_byte_bounds_per_stream_and_in_total() -> None:
    one = chunk_bytes(_chunk("x", 0))
    assert one == CHUNK_BYTES + TOKEN_BYTES
    buf = ReplayBuffer(ReplayLimits(max_chunks=100, max_bytes=3 * one, total_bytes=5 * one))
    for seq in range(6):
        buf.keep(_chunk("a", seq))
    assert [c.seq for c in buf.since("a", 3, 6)] == [3, 4, 5] and buf.bytes == 3 * one
    # Other streams: the total bound takes from the stream that appended least recently ("a").
    for seq in range(3):
        buf.keep(_chunk("b", seq))
    assert buf.bytes == 5 * one
    assert buf.since("a", 3, 6) is None and [c.seq for c in buf.since("a", 4, 6)] == [4, 5]
    assert [c.seq for c in buf.since("b", 0, 3)] == [0, 1, 2]
    buf.keep(_chunk("c", 0))
    buf.keep(_chunk("c", 1))  # "a" loses its last chunk: its entry goes
    assert "a" not in buf and buf.bytes == 5 * one
    buf.keep(_chunk("a", 6))  # a later chunk of a live stream starts over from its own seq; "b" is now the oldest
    assert buf.since("a", 5, 7) is None and [c.seq for c in buf.since("a", 6, 7)] == [6]
    assert buf.since("b", 0, 3) is None and [c.seq for c in buf.since("b", 1, 3)] == [1, 2]
    assert buf.bytes == 5 * one
    # A chunk larger than a stream's bound is not kept at all.
    buf.keep(_chunk("big", 0, n=200))
    assert buf.since("big", 0, 1) is None and buf.bytes <= 5 * one


def test_the_buffer_frees_an_ended_stream_after_its_grace_and_a_cancelled_one_at_once() -> None:
    clock = _Clock()
    buf = ReplayBuffer(ReplayLimits(linger_s=5.0), clock=clock)
    for seq in range(3):
        buf.keep(_chunk("done", seq))
    buf.keep(_chunk("done", 3, finish="length"))
    buf.keep(_chunk("aborted", 0))
    buf.keep(_chunk("aborted", 1, finish="abort"))
    buf.keep(_chunk("live", 0))
    clock.now += 4.0
    # The tail of a finished stream is replayed (live=False: the worker no longer runs it), its last chunk too.
    assert [(c.seq, c.finish_reason) for c in buf.since("done", 2, None)] == [(2, None), (3, "length")]
    buf.keep(_chunk("cancelled", 0))
    buf.forget("cancelled")  # the gateway's cancel: it will ask for no replay
    assert "cancelled" not in buf
    clock.now += 1.5
    buf.expire()
    assert "done" not in buf and "aborted" not in buf and "live" in buf
    assert buf.bytes == chunk_bytes(_chunk("live", 0))
    assert buf.since("done", 2, None) is None
    for seq in range(1, 50):
        buf.keep(_chunk("live", seq))
    buf.keep(_chunk("live", 50, finish="stop"))
    clock.now += 5.0
    buf.expire()
    assert len(buf) == 0 and buf.bytes == 0


def _migrations(mesh: Mesh) -> float:
    return mesh.gateway.ctx.metrics.migrations.labels("tiny")._value.get()


def _metric(mesh: Mesh, name: str) -> float:
    text = httpx.get(f"{mesh.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("case", ["replayed", "ended", "missed"])
def test_a_busy_stream_survives_the_gateway_losing_its_nats_server(tmp_path, case) -> None:  # noqa: ANN001
    """The gateway's NATS server dies while its worker (on another server) streams: the gateway reconnects to
    a third server, the chunks sent meanwhile are lost, and the worker resends them: identical output, no
    migration (before: the stream migrated). replayed: the next chunk after the reconnect shows a gap. ended:
    the stream ended while the gateway was away (silence, then the replay of its tail, last chunk included).
    missed: the worker keeps no chunks, so the replay misses and the stream migrates, still complete."""
    kept = case != "missed"
    max_tokens, away_s = (8, 2.5) if case == "ended" else (300, 0.6)
    model_dir = build_checkpoint("llama", tmp_path / "llama", max_position_embeddings=1024).path
    (tmp_path / "nats").mkdir()
    mesh = Mesh(tmp_path / "nats", model_dir, nats_servers=3, worker_expiry_s=5.0, stream_idle_timeout_s=30.0)
    try:
        mesh.start_tokenizer()
        d0 = mesh.start_decoder("d0", num_kv_blocks=512)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 1)
        if not kept:
            d0.replay = ReplayBuffer(ReplayLimits(max_chunks=0))
        nc = mesh.gateway.ctx.nc
        victim = mesh.homes[id(nc)]
        assert mesh.homes[id(d0.nc)] != victim
        # The gateway stays away a while before it connects to the next server (a restarting server, a slow
        # network): the worker certainly sends chunks meanwhile.
        select_next_server = nc._select_next_server
        running_when_back: list[int] = []

        async def slowly() -> None:
            await asyncio.sleep(away_s)
            running_when_back.append(len(d0.requests))
            await select_next_server()
        nc._select_next_server = slowly
        reconnects = nc.stats["reconnects"]
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        args = dict(model="tiny", prompt="Hello", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        reference = client.completions.create(**args).choices[0].text
        if case == "ended":
            # The engine pauses 1 s: the request reaches the worker, the gateway loses its server, then the worker
            # sends every chunk (and ends the stream) while the gateway is away.
            received = d0.num_received
            stalled = mesh.call_soon(d0.thread.call(lambda e: time.sleep(1.0)))
            with ThreadPoolExecutor(1) as pool:
                streamed = pool.submit(lambda: list(client.completions.create(**args, stream=True)))
                mesh.wait_until(lambda: d0.num_received > received)
                mesh.cluster.kill(victim)
                stalled.result(30)
                chunks = streamed.result(60)
            text = ""
            assert running_when_back[0] == 0  # the worker had finished: its tail was replayed from the buffer
        else:
            stream = client.completions.create(**args, stream=True)
            text = next(iter(stream)).choices[0].text
            mesh.cluster.kill(victim)
            mesh.wait_until(lambda: nc.stats["reconnects"] > reconnects, timeout=10)
            chunks = list(stream)
        text += "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert text == reference  # every token, once, in order
        served, missed = d0.replay.served, d0.replay.missed
        if kept:
            assert _migrations(mesh) == 0
            assert (served, missed) == (1, 0)
        else:
            assert _migrations(mesh) == 1
            assert (served, missed) == (0, 1)
        mesh.wait_until(lambda: _metric(mesh, "kvmesh:stream_replays_total") == served
                        and _metric(mesh, "kvmesh:stream_replay_misses_total") == missed, timeout=5)
        # Nothing left behind: the worker's engine and (past the grace) its buffer hold nothing more.
        mesh.wait_until(lambda: mesh.held("d0") == 0, timeout=5)

        async def past_the_grace() -> tuple[int, int]:
            d0.replay.limits = ReplayLimits(linger_s=0.0)
            d0.replay.expire()
            return len(d0.replay), d0.replay.bytes
        assert mesh.call(past_the_grace()) == (0, 0)
    finally:
        mesh.close()
