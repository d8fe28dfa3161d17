"""A mesh sent more than it computes (--max-queue-wait): a new request it is expected not to start in time gets
a 429 with Retry-After at once, and one sent that has not started by the bound is dropped in its worker (no KV
block or engine slot left behind) and answered 503 with Retry-After. Real nats-server, real gateway and decode
worker, the real openai client."""
from __future__ import annotations

import math
import time

import openai
import pytest

from services.gateway.queue_wait import MIN_STARTS, WINDOW_S, QueueWait
from tests.checkpoints import build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client

BOUND_S = 1.5


class _Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def test_expected_wait_follows_the_queue_and_the_start_rate() -> None:
    clock = _Clock()
    q = QueueWait(clock)
    assert q.expected_wait_s() == 0.0
    t = q.enter()
    clock.offset = 4.0
    assert q.start_rate() is None and 3.9 < q.expected_wait_s() < 4.5  # nothing started: the oldest waiter's age
    q.leave(t, started=True)
    for _ in range(MIN_STARTS):  # one start every 2 s
        clock.offset += 2.0
        q.leave(q.enter(), started=True)
    rate = q.start_rate()
    assert rate is not None and 0.4 < rate < 0.6
    waiting = [q.enter() for _ in range(9)]
    assert 15 < q.expected_wait_s() < 25  # 10 ahead of a new one (it included) at ~0.5/s
    for w in waiting:
        q.leave(w, started=False)  # given up, not started: no start counted
    assert q.waiting == 0 and q.expected_wait_s() == 0.0 and q.start_rate() == pytest.approx(rate, rel=0.01)
    clock.offset += WINDOW_S + 1
    assert q.start_rate() is None  # old starts say nothing about now


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("queue_wait") / "llama").path
    with one_decoder_mesh(tmp_path_factory, "queue_wait", model_dir=model_dir, max_queue_wait_s=BOUND_S) as m:
        yield m


def _idle(mesh) -> bool:  # noqa: ANN001
    held, free, total = mesh.engine_state(mesh.decoders["d0"])
    return held == 0 and free == total and not mesh.decoders["d0"].requests.ids()


def test_a_request_not_started_in_time_gets_a_503_and_leaves_nothing_in_the_engine(mesh) -> None:  # noqa: ANN001
    client = openai_client(mesh)
    d0 = mesh.decoders["d0"]
    stalled = mesh.call_soon(d0.thread.call(lambda e: time.sleep(BOUND_S + 2.5)))  # the engine busy past the bound
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
                                       stream=True)
    waited = time.monotonic() - t0
    assert BOUND_S <= waited < BOUND_S + 2.0, waited  # answered at the bound, not when the engine got free
    err = info.value
    assert err.status_code == 503 and err.body["code"] == "queue_timeout" and err.body["type"] == "server_error"
    assert "--max-queue-wait" in err.body["message"]
    assert float(err.response.headers["retry-after-ms"]) >= 1000
    assert int(err.response.headers["retry-after"]) == math.ceil(float(err.response.headers["retry-after-ms"]) / 1000)
    stalled.result(30)
    mesh.wait_until(lambda: _idle(mesh), timeout=10)  # the worker was told to drop it: nothing held
    assert mesh.gateway.ctx.model.queue.waiting == 0
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason == "length"


def test_a_request_the_mesh_cannot_start_in_time_gets_a_fast_429(mesh) -> None:  # noqa: ANN001
    """The mesh started requests at ~0.5 a second lately and 10 wait: a new one would wait ~20 s, over the bound."""
    clock = _Clock()
    served = mesh.gateway.ctx.model
    real, served.queue = served.queue, QueueWait(clock)
    try:
        q = served.queue
        clock.offset = -10.0
        for _ in range(5):
            clock.offset += 2.0
            q.leave(q.enter(), started=True)
        clock.offset = 0.0
        waiting = [q.enter() for _ in range(10)]
        client = openai_client(mesh)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert time.monotonic() - t0 < 1.0  # at once, nothing sent to the worker
        err = info.value
        assert err.status_code == 429 and err.body["code"] == "server_overloaded"
        assert err.body["type"] == "rate_limit_error" and "--max-queue-wait" in err.body["message"]
        # Retry-After: when the excess over the bound should have started (jittered), within what openai honours.
        retry = float(err.response.headers["retry-after-ms"]) / 1000
        assert 1.0 <= retry <= 60 and int(err.response.headers["retry-after"]) == math.ceil(retry)
        assert mesh.gateway.ctx.in_flight == 0 and not mesh.decoders["d0"].requests.ids()
        for w in waiting:
            q.leave(w, started=True)  # the queue started: new requests are served again
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    finally:
        served.queue = real


def test_kvmesh_up_passes_max_queue_wait_to_the_gateway() -> None:
    import argparse

    from services.gateway.service import add_arguments as gateway_arguments
    from shared.launcher.process_spec import MeshOptions, mesh_services
    from shared.launcher.up import add_arguments as up_arguments

    up = argparse.ArgumentParser()
    up_arguments(up)
    assert up.parse_args(["--max-queue-wait", "12.5"]).max_queue_wait == 12.5
    args = {s.service: s.args for s in mesh_services(MeshOptions(model="m", max_queue_wait=12.5))}["gateway"]
    i = args.index("--max-queue-wait")
    gateway = argparse.ArgumentParser()
    gateway_arguments(gateway)
    assert gateway.parse_args(["--model", "m", "--max-queue-wait", args[i + 1]]).max_queue_wait == 12.5
    default = {s.service: s.args for s in mesh_services(MeshOptions(model="m"))}["gateway"]
    assert "--max-queue-wait" not in default  # the gateway's own default (GatewayConfig.max_queue_wait_s)
