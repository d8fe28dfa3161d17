"""/metrics must not hold the gateway's event loop: every worker's latest beat becomes series in /metrics, and a
worker's beat may carry long lists (draft positions, step-size buckets). Beats from many worker ids with the
longest lists the wire allows, sent over a real nats-server to a real gateway, make a scrape render for seconds;
/health must keep answering meanwhile, and a burst of scrapes costs one render. Beats over the wire's bounds are
refused by the codec.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from shared import bus, subjects, wire
from shared.protocol.events import MAX_ADAPTERS, MAX_NAME, LoadBeat
from tests.gateway_harness import one_decoder_mesh

FAKE_WORKERS = 300  # with the longest lists: about 45,000 series, seconds of rendering on a busy 2-core machine
HEALTH_BOUND_S = 2.5
SCRAPES = 5  # on the loop, five renders in a row; off it, one shared


def _longest(field: str) -> int:
    return next(m.max_length for m in LoadBeat.model_fields[field].metadata if hasattr(m, "max_length"))


def _maximal_beat(worker_id: str) -> LoadBeat:
    per_pos, buckets = _longest("spec_num_accepted_tokens_per_pos"), _longest("iteration_token_buckets")
    return LoadBeat(worker_id=worker_id, running=1, waiting=0, free_blocks=1, total_blocks=2, role="decode",
                    spec_num_drafts=1, spec_num_accepted_tokens_per_pos=list(range(per_pos)),
                    iteration_token_buckets=list(range(buckets)), iteration_token_counts=list(range(buckets + 1)))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "secmetrics") as m:
        yield m


def test_health_answers_while_metrics_renders_many_maximal_beats(mesh) -> None:  # noqa: ANN001
    stop = threading.Event()

    async def beat_forever() -> None:  # keeps the fake workers alive (beats expire) for the whole test
        nc = await bus.connect(mesh.nats.url)
        try:
            beats = [_maximal_beat(f"fake-{i}") for i in range(FAKE_WORKERS)]
            while not stop.is_set():
                for b in beats:
                    await bus.publish(nc, subjects.decode_load(b.worker_id), b)
                await nc.flush()
                await asyncio.sleep(1.0)
        finally:
            await nc.close()

    beating = mesh.call_soon(beat_forever(), timeout=300)
    try:
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == FAKE_WORKERS + 1, timeout=30)
        texts: list[bytes] = []
        answers: list[tuple[int, float]] = []  # /health's status and time
        scraped = threading.Event()

        def scrape() -> None:
            texts.append(httpx.get(f"{mesh.url}/metrics", timeout=120).content)

        def poll_health() -> None:
            while not scraped.is_set():
                t0 = time.monotonic()
                status = httpx.get(f"{mesh.url}/health", timeout=60).status_code
                answers.append((status, time.monotonic() - t0))
                time.sleep(0.05)

        health = threading.Thread(target=poll_health, daemon=True)
        health.start()
        time.sleep(0.2)
        scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(SCRAPES)]
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join(300)
        scraped.set()
        health.join(60)
        worst = max(s for _, s in answers)
        assert worst < HEALTH_BOUND_S, f"/health took {worst:.1f}s while /metrics rendered"
        # A held loop also misses beats: the mesh's own worker would expire and /health say 503.
        assert {status for status, _ in answers} == {200}, answers
        assert len(texts) == SCRAPES
        text = texts[0].decode()
        assert 'worker="fake-7"' in text and 'worker="d0"' in text
        assert f'position="{_longest("spec_num_accepted_tokens_per_pos") - 1}"' in text
    finally:
        stop.set()
        beating.result(30)


@pytest.mark.parametrize("field,value", [
    ("worker_id", "w" * (MAX_NAME + 1)),
    ("kv_endpoint", "tcp://" + "h" * MAX_NAME),
    ("lora_adapters", ["a"] * (MAX_ADAPTERS + 1)),
    ("lora_resident", ["x" * (MAX_NAME + 1)]),
    ("spec_num_accepted_tokens_per_pos", list(range(_longest("spec_num_accepted_tokens_per_pos") + 1))),
])
def test_beats_over_the_wire_bounds_are_refused(field: str, value: object) -> None:
    body = _maximal_beat("w").model_dump() | {field: value, wire.KIND_KEY: LoadBeat.KIND, wire.VERSION_KEY: 1}
    import msgpack

    with pytest.raises(wire.WireError):
        wire.decode(msgpack.packb(body, use_bin_type=True), LoadBeat)
