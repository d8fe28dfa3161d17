"""The router on a real mesh (real nats-server, gateway, tokenizer and decode workers on a tiny checkpoint,
requests through the openai client): it sends less to a decode worker it sees answer slowly, and a worker whose
credential beats claiming no load while it holds many requests draws no more than its share.

The attack runs on the locked-down bus `kvmesh up` makes (one bus user per process, subject permissions:
tests/gateway_harness.py, shared/bus/roles.py): the liar is a real decode worker on its own credential, slowed
so it holds what it is sent, whose every beat says it runs nothing, waits on nothing and has every block free.
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh, openai_client

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("router-mesh") / "llama").path


def slow_down(mesh: Mesh, worker_id: str, step_sleep_s: float) -> None:
    """Every engine step of the worker takes step_sleep_s longer (a slow device)."""
    def patch(engine) -> None:  # noqa: ANN001 - runs on the engine thread
        step = engine.step

        def slow_step():  # noqa: ANN202
            time.sleep(step_sleep_s)
            return step()
        engine.step = slow_step
    mesh.call(mesh.decoders[worker_id].thread.call(patch))


def count_routes(mesh: Mesh) -> Counter:
    """The decode worker of every routing decision the gateway makes from now on."""
    router = mesh.gateway.ctx.router
    picked: Counter = Counter()
    pick = router.pick

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        route = pick(*args, **kwargs)
        picked[route.worker_id] += 1
        return route
    router.pick = counted
    return picked


def run_requests(mesh: Mesh, count: int, concurrency: int, spacing_s: float) -> list[str]:
    """`count` completions with distinct prompts (no cache hit anywhere: load alone decides), `concurrency` at a
    time, started `spacing_s` apart; returns each one's finish reason (an exception fails the test)."""
    client = openai_client(mesh)
    model = client.models.list().data[0].id

    def one(i: int) -> str:
        time.sleep(spacing_s * i)
        prompt = [(7 * i + 3 * k) % 250 + 3 for k in range(24)]
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(count)))


def test_a_slow_decode_worker_gets_clearly_fewer_requests_and_nothing_times_out(model_dir, tmp_path_factory) -> None:
    mesh = Mesh(tmp_path_factory.mktemp("nats-slow"), model_dir, stream_idle_timeout_s=30.0)
    try:
        mesh.start_tokenizer()
        for w in ("fast", "slow"):
            mesh.start_decoder(w)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2, timeout=30)
        slow_down(mesh, "slow", 0.1)
        admitted = count_routes(mesh)
        reasons = run_requests(mesh, count=24, concurrency=6, spacing_s=0.05)
        assert reasons == ["length"] * 24  # nobody timed out or failed
        assert admitted["fast"] + admitted["slow"] == 24
        # Each of the slow worker's tokens takes 100 ms more: the gateway sees it and sends it clearly less.
        assert admitted["slow"] * 2 <= admitted["fast"], admitted
        slow = mesh.gateway.ctx.router.observed("slow")
        fast = mesh.gateway.ctx.router.observed("fast")
        assert slow.flights == {} and fast.flights == {}
        if admitted["slow"]:  # it served streams: the gateway measured it slower (none: nothing to measure)
            assert slow.gap.value > fast.gap.value, (slow.gap, fast.gap)
        # A client that goes away mid-stream: the stream's count on its worker ends with it.
        client = openai_client(mesh)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                           max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        assert sum(len(o.flights) for o in (slow, fast)) == 1
        stream.close()
        mesh.wait_until(lambda: not slow.flights and not fast.flights, timeout=10)
    finally:
        mesh.close()


def test_a_worker_beating_zero_load_does_not_draw_a_disproportionate_share(model_dir, tmp_path_factory) -> None:
    # The liar's id sorts first: the old router broke ties (two "idle" workers) its way.
    mesh = Mesh(tmp_path_factory.mktemp("nats-liar"), model_dir, locked_workers=("d0", "d1"),
                stream_idle_timeout_s=30.0)
    try:
        mesh.start_tokenizer()
        for w in ("d0", "d1"):
            mesh.start_decoder(w)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2, timeout=30)
        liar = mesh.decoders["d0"]
        publish = liar.beats._publish

        async def forged(beat):  # noqa: ANN001, ANN202
            await publish(beat.model_copy(update={"running": 0, "waiting": 0, "free_blocks": beat.total_blocks}))
        liar.beats._publish = forged
        slow_down(mesh, "d0", 0.08)
        admitted = count_routes(mesh)
        reasons = run_requests(mesh, count=24, concurrency=8, spacing_s=0.1)
        assert reasons == ["length"] * 24
        assert admitted["d0"] + admitted["d1"] == 24
        # The liar held what it was sent (each of its requests takes a second) and said it held nothing: the
        # router counted the streams it sent there and saw them crawl, and gave it less than half.
        assert admitted["d0"] < 12, admitted
        assert mesh.gateway.ctx.router.observed("d0").routed == admitted["d0"]
    finally:
        mesh.close()
