"""The gateway under more streams than it can carry (issue 25): it refuses new requests at its bound with a
fast OpenAI error instead of slowing every stream down, and a token stream it lost (NATS cut it off as a slow
consumer, or dropped its messages) ends with an error event instead of hanging. Real nats-server, real
decode workers, the real openai client over HTTP."""
from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.nats_fixtures import nats_server  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201 - one checkpoint for the module's meshes
    return build_checkpoint("llama", tmp_path_factory.mktemp("overload") / "llama").path


def _metric(mesh, name: str) -> float:  # noqa: ANN001
    for line in mesh.gateway.ctx.metrics.render().decode().splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_past_the_inflight_bound_a_request_gets_a_fast_429(tmp_path_factory, model_dir) -> None:  # noqa: ANN001
    with one_decoder_mesh(tmp_path_factory, "admission", model_dir=model_dir, max_inflight_requests=2) as mesh:
        client = openai_client(mesh)
        d0 = mesh.decoders["d0"]
        args = dict(model="tiny", prompt="Hello", max_tokens=200, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
        streams = [client.completions.create(**args) for _ in range(2)]  # each has its first token
        # The engine busy for 4 s: both streams stay in flight whatever the machine's speed.
        stalled = mesh.call_soon(d0.thread.call(lambda e: time.sleep(4.0)))
        assert mesh.gateway.ctx.in_flight == 2
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(**args)
        assert time.monotonic() - t0 < 1.0, "the refusal waited for the busy engine"
        err = info.value
        assert err.status_code == 429 and int(err.response.headers["retry-after"]) >= 1
        assert err.body["code"] == "too_many_requests" and "--max-inflight-requests" in err.body["message"]
        with pytest.raises(openai.RateLimitError) as again:  # chat too, and the non-streamed form
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        # Two refusals under the same load: Retry-After follows the backlog, with jitter, never one value for all.
        waits = [float(e.response.headers["retry-after-ms"]) / 1000 for e in (err, again.value)]
        assert waits[0] != waits[1] and all(0.25 <= w <= 60 for w in waits)
        assert all(int(e.response.headers["retry-after"]) == max(1, math.ceil(w)) for e, w in zip((err, again.value), waits))
        assert mesh.gateway.ctx.in_flight == 2  # refused requests leave nothing counted
        assert _metric(mesh, 'kvmesh:gateway_requests_rejected_total{model_name="tiny",reason="max_inflight_requests"}') == 2
        assert _metric(mesh, "kvmesh:gateway_max_inflight_requests") == 2
        assert _metric(mesh, 'kvmesh:request_errors_total{model_name="tiny",status="429"}') == 2
        # The admitted streams are untouched: they run to the end once the engine is free.
        stalled.result(30)
        for s in streams:
            chunks = list(s)
            assert sum(1 for c in chunks if c.choices and c.choices[0].text is not None) >= 199
            assert chunks[-1].choices[0].finish_reason == "length"
        mesh.wait_until(lambda: mesh.gateway.ctx.in_flight == 0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason == "length"
        # /health and /metrics are not generation requests: never refused.
        assert httpx.get(f"{mesh.url}/health").status_code == 200


def test_a_gateway_late_on_its_input_does_not_declare_its_workers_dead(tmp_path_factory, model_dir) -> None:  # noqa: ANN001
    """The gateway's event loop stalls for twice the worker expiry (as when it serves more tokens than its CPU
    carries): every beat is late at once. Judged by the wall clock, the streaming worker was "dead" and its
    request migrated; judged by what the gateway hears (router.Router._silent), nothing moves."""
    with one_decoder_mesh(tmp_path_factory, "late", model_dir=model_dir, worker_expiry_s=1.0) as mesh:
        mesh.start_decoder("d1")
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2)
        client = openai_client(mesh)
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=300, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})

        async def stall() -> None:
            time.sleep(2.0)  # the whole loop: the gateway, and (same loop here) the workers' beats

        mesh.call(stall())
        tokens = sum(1 for c in stream if c.choices and c.choices[0].text is not None)
        assert tokens >= 299
        assert _metric(mesh, "kvmesh:request_migrations_total") == 0
        assert len(mesh.gateway.ctx.router.alive()) == 2


def test_a_stream_whose_messages_were_dropped_fails_at_once(nats_server: str) -> None:
    """nats-py drops messages of a subscription whose queue is full and tells only the connection's error
    callback. The dropped ones here include the end marker: without the check the receiver would wait its
    whole idle timeout (30 s here, 120 s in the gateway) for a stream that can never end."""
    from shared import bus
    from shared.bus.limits import BusLimits
    from shared.bus.stream import StreamReply
    from shared.protocol.generate import CancelRequest

    async def go() -> None:
        sender, receiver = await bus.connect(nats_server), await bus.connect(nats_server)
        try:
            async def serve(msg) -> None:  # noqa: ANN001 - a responder streaming 50 items and the end marker
                out = StreamReply(sender, msg.reply)
                for i in range(50):
                    await out.send(CancelRequest(request_id=f"r{i}", reason="item"))
                await out.end()

            await sender.subscribe("items", cb=serve)
            await sender.flush()  # the server knows the responder before the request goes out
            stream = await bus.request_stream(receiver, "items", CancelRequest(request_id="q", reason="go"),
                                              timeout=30.0, expect=CancelRequest,
                                              limits=BusLimits(reply_pending_msgs=8))
            deadline = time.monotonic() + 10
            while not stream.dropped:  # the receiver reads nothing meanwhile: its queue holds 8
                assert time.monotonic() < deadline, "nothing was dropped"
                await asyncio.sleep(0.01)
            got = []
            t0 = time.monotonic()
            with pytest.raises(bus.MessagesDroppedError):
                async for item in stream:
                    got.append(item)
            assert time.monotonic() - t0 < 5.0 and len(got) <= 8  # not the 30 s idle timeout
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(go())


def test_a_gateway_stream_that_lost_messages_ends_with_an_error_event_and_cancels(tmp_path_factory, model_dir) -> None:  # noqa: ANN001
    """The same in the gateway: its stream's inbox holds 4 messages; the event loop stalls while the worker's
    engine keeps generating, so the worker's token messages arrive at once and the client library drops some.
    The client's stream ends with a 503 error event instead of hanging, and the worker frees the request."""
    with one_decoder_mesh(tmp_path_factory, "dropped", model_dir=model_dir, stream_pending_msgs=4, worker_expiry_s=30.0) as mesh:
        client = openai_client(mesh)
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=500, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})

        async def stall() -> None:
            time.sleep(1.0)  # the whole loop; the worker's engine thread keeps generating meanwhile

        mesh.call(stall())
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 20
        assert "fell behind" in str(info.value)
        mesh.wait_until(lambda: mesh.held("d0") == 0, timeout=10)


def test_a_gateway_behind_its_input_refuses_new_requests_until_it_caught_up(tmp_path_factory, model_dir) -> None:  # noqa: ANN001
    """The gateway's input lag (a probe it sends itself over NATS, services/gateway/input_lag.py) above
    --max-input-lag: new requests get the fast 429 whatever the count in flight; once caught up, served."""
    with one_decoder_mesh(tmp_path_factory, "lag", model_dir=model_dir, max_input_lag_s=0.5, worker_expiry_s=30.0) as mesh:
        client = openai_client(mesh)
        mesh.wait_until(lambda: mesh.gateway.ctx.input_lag_s() > 0 or _metric(mesh, "kvmesh:gateway_input_lag") > 0)

        async def stall() -> None:
            time.sleep(1.5)  # the gateway's loop behind: the probe that is out comes back 1.5 s late

        stalled = mesh.call_soon(stall())
        time.sleep(0.3)
        with pytest.raises(openai.RateLimitError) as info:  # arrives during the stall, judged right after it
            client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        stalled.result(10)
        assert "behind its input" in info.value.body["message"]
        assert _metric(mesh, 'kvmesh:gateway_requests_rejected_total{model_name="tiny",reason="input_lag"}') >= 1
        mesh.wait_until(lambda: mesh.gateway.ctx.input_lag_s() < 0.5)
        assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"


def test_the_input_lag_probe_always_stops(nats_server: str) -> None:
    """Stopped at any point of its loop (a probe out, between probes, right as one comes back), the probe ends:
    before Python 3.12 asyncio.wait_for can swallow the cancellation, and the gateway's drain then hung (about 1
    in 3 test meshes did before the stop flag)."""
    from services.gateway.input_lag import InputLag
    from shared import bus

    async def go() -> None:
        nc = await bus.connect(nats_server)
        try:
            for i in range(40):
                lag = InputLag(nc, period_s=0.001)
                await lag.start()
                await asyncio.sleep(0.002 * (i % 7))
                await asyncio.wait_for(lag.stop(), 5)
            assert lag.seconds() >= 0
        finally:
            await nc.close()

    asyncio.run(go())


def test_bench_serve_retries_refused_requests_after_a_spread_retry_after(tmp_path_factory, model_dir) -> None:  # noqa: ANN001
    """kvmesh's own load generator against the bound (`bench serve --retries`): the gateway takes one request at
    a time, six arrive at once; the refused come back when the gateway's Retry-After (with jitter, both sides)
    says, at spread-out times, and every one is served in the end."""
    from loadtest.serve.datasets import Job, Turn, Workload
    from loadtest.serve.load import LoadConfig, run_level
    from loadtest.serve.payload import Endpoint

    with one_decoder_mesh(tmp_path_factory, "retries", model_dir=model_dir, max_inflight_requests=1) as mesh:
        ep = Endpoint(mesh.url, "tiny", extra_body={"ignore_eos": True})
        jobs = tuple(Job(i, (Turn("Hello there", 8, 2),)) for i in range(6))
        cfg = LoadConfig(num_warmups=0, progress=False, retries=30, request_timeout=60)
        run = asyncio.run(run_level(ep, Workload("retries", jobs), cfg, time.perf_counter() + 90))
        assert [r.ok for r in run.results] == [True] * 6, [r.error for r in run.results]
        retried = [r for r in run.results if r.retries]
        assert retried, "nothing was refused: the bound did not bite"
        # The refused were told different waits and came back at different times.
        starts = sorted(r.start for r in retried)
        assert len(set(round(s, 3) for s in starts)) == len(starts)
        assert all(r.retry_wait_s >= 0.25 for r in retried)  # the gateway's floor, honoured
        assert _metric(mesh, 'kvmesh:gateway_requests_rejected_total{model_name="tiny",reason="max_inflight_requests"}') \
            == sum(r.retries for r in run.results)


def test_the_input_lag_limit_follows_the_machines_floor() -> None:
    """The floor is the smallest round trip of the window: one quick probe keeps it low (a stall or a backlog
    refuses at the bound), a machine whose every probe is slow for the whole window raises it."""
    from services.gateway.input_lag import LagFloor

    floor = LagFloor(window_s=30.0)
    assert floor.seconds(0.0) == 0.0
    for t in range(30):  # a busy machine: every trip 0.3-0.4 s ...
        floor.note(0.3 + 0.1 * (t % 2), float(t))
    assert floor.seconds(30.0) == 0.3
    floor.note(0.01, 30.5)  # ... one quick trip: the floor is low again for a whole window
    assert floor.seconds(31.0) == 0.01 and floor.seconds(60.0) == 0.01
    floor.note(0.5, 61.0)
    assert floor.seconds(61.0) == 0.5  # the quick one has left the window


def test_a_busy_machine_does_not_refuse_but_a_stall_still_does(nats_server: str) -> None:
    """The real probe over a real nats-server, on a loop that other work keeps busy (as processes sharing the
    cores would): each probe comes back about 0.2 s late, over a bound of 0.1 s. Judged against the floor the
    steady delay refuses nobody; a 1 s stall on top does."""
    from services.gateway.input_lag import FLOOR_FACTOR, InputLag
    from shared import bus

    bound = 0.1

    async def go() -> None:
        nc = await bus.connect(nats_server)
        lag = InputLag(nc, period_s=0.01, floor_window_s=3.0)
        busy = True

        async def other_processes() -> None:
            while busy:
                time.sleep(0.2)  # holds the loop: every probe out waits behind it
                await asyncio.sleep(0.005)

        await lag.start()
        hog = asyncio.ensure_future(other_processes())
        try:
            await asyncio.sleep(4.0)  # more than the floor's window: every trip in it was slow
            samples = []
            for _ in range(16):
                samples.append((lag.seconds(), lag.limit(bound)))
                await asyncio.sleep(0.05)  # (held up by the other work too)
            assert sum(1 for s, _ in samples if s > bound) > 8, samples  # the plain bound would refuse, mostly
            assert all(s <= limit for s, limit in samples), samples  # judged against the floor: nobody
            assert all(limit > FLOOR_FACTOR * 0.15 for _, limit in samples)
            time.sleep(1.0)  # a stall: the gateway behind its input by far more than the machine's usual
            assert lag.seconds() > lag.limit(bound)
        finally:
            busy = False
            await hog
            await lag.stop()
            await nc.close()

    asyncio.run(go())
