"""The planner (issue 25 section 3): settings refused at start with the flag named, metrics read from the
gateway's Prometheus text, the load and SLA policies' directions, limits, budget and hysteresis, decisions
kept with their reasons and served over HTTP, a scaler that fails or a worker that dies while scaling, and
the supervisor's scaler starting and draining real processes."""
from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.cli import main
from shared.engine.sim_profile import DEFAULT_PROFILE, CostModel, load_profile
from shared.launcher.process_spec import ProcessSpec
from shared.launcher.supervisor import Supervisor
from shared.planner.config import PlannerConfig, PlannerConfigError, RoleLimits
from shared.planner.endpoint import PlannerEndpoint
from shared.planner.observe import Snapshot, observe, parse_metrics
from shared.planner.planner import Planner
from shared.planner.policy import LoadPolicy, SlaPolicy
from shared.planner.scaler import SupervisorScaler


def limits(pmin=0, pmax=4, dmin=1, dmax=4) -> dict[str, RoleLimits]:  # noqa: ANN001
    return {"prefill": RoleLimits(pmin, pmax), "decode": RoleLimits(dmin, dmax)}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(mode="load", limits=limits(pmin=3, pmax=2)), "--prefill-min \\(3\\) is above --prefill-max \\(2\\)"),
    (dict(mode="load", limits=limits(dmin=0)), "--decode-min must be >= 1"),
    (dict(mode="sla", limits=limits(), ttft_slo_s=0.0, itl_slo_s=0.05), "--ttft-slo-ms must be > 0"),
    (dict(mode="sla", limits=limits(), ttft_slo_s=1.0, itl_slo_s=None), "needs --itl-slo-ms"),
    (dict(mode="load", limits=limits(pmin=2, dmin=2), budget=3), "cannot hold the minima"),
    (dict(mode="fast", limits=limits()), "load or sla"),
])
def test_bad_settings_are_refused_naming_the_flag(kwargs: dict, needle: str) -> None:
    with pytest.raises(PlannerConfigError, match=needle):
        PlannerConfig(**kwargs)


@pytest.mark.parametrize("flags, needle", [
    (["--planner", "load", "--decode-min", "3", "--decode-max", "2"], "--decode-min (3) is above --decode-max (2)"),
    (["--planner", "sla", "--ttft-slo-ms", "0", "--itl-slo-ms", "50"], "--ttft-slo-ms must be > 0"),
    (["--planner", "sla", "--ttft-slo-ms", "500", "--itl-slo-ms", "50", "--planner-profile", "BAD"], "is not JSON"),
    (["--engine", "sim", "--sim-profile", "BAD"], "is not JSON"),
])
def test_kvmesh_up_refuses_bad_planner_input_at_start(tmp_path, capsys, flags: list[str], needle: str) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.json"
    bad.write_text("{ nope")
    flags = [str(bad) if f == "BAD" else f for f in flags]
    assert main(["up", "--port", "0", *flags]) == 2
    assert needle in capsys.readouterr().err


def _metrics_text(finished: int, in_flight: int, ttft: list[float], itl: list[float], prompt: int, gen: int,
                  waiting: dict[str, float], usage: float, workers: dict[str, int]) -> str:
    r = CollectorRegistry()
    Counter("kvmesh:request_success", "", ["model_name", "finished_reason"], registry=r).labels("m", "length").inc(finished)
    Counter("kvmesh:prompt_tokens", "", ["model_name"], registry=r).labels("m").inc(prompt)
    Counter("kvmesh:generation_tokens", "", ["model_name"], registry=r).labels("m").inc(gen)
    for name, total in (("kvmesh:request_prompt_tokens", prompt), ("kvmesh:request_generation_tokens", gen)):
        h = Histogram(name, "", ["model_name"], registry=r, buckets=(10, 100, 1000, 10000))
        for _ in range(finished):
            h.labels("m").observe(total / finished)
    Gauge("kvmesh:gateway_requests_in_flight", "", ["model_name"], registry=r).labels("m").set(in_flight)
    h = Histogram("kvmesh:time_to_first_token_seconds", "", ["model_name"], registry=r, buckets=(0.1, 0.5, 1.0, 5.0))
    for v in ttft:
        h.labels("m").observe(v)
    h = Histogram("kvmesh:inter_token_latency_seconds", "", ["model_name"], registry=r, buckets=(0.01, 0.05, 0.1))
    for v in itl:
        h.labels("m").observe(v)
    w = Gauge("kvmesh:num_requests_waiting", "", ["model_name", "worker", "role"], registry=r)
    u = Gauge("kvmesh:kv_cache_usage_perc", "", ["model_name", "worker", "role"], registry=r)
    alive = Gauge("kvmesh:workers_alive", "", ["model_name", "role"], registry=r)
    for role, n in workers.items():
        alive.labels("m", role).set(n)
        for i in range(n):
            w.labels("m", f"{role}-{i}", role).set(waiting.get(role, 0.0) / n)
            u.labels("m", f"{role}-{i}", role).set(usage if role == "decode" else 0.0)
    return generate_latest(r).decode()


def test_observations_are_the_difference_of_two_metric_snapshots() -> None:
    a = parse_metrics(_metrics_text(10, 2, [0.2] * 10, [0.02] * 100, 1000, 500, {}, 0.1, {"decode": 2}), at=0.0)
    b = parse_metrics(_metrics_text(30, 4, [0.2] * 10 + [2.0] * 20, [0.02] * 100 + [0.08] * 50, 5000, 1500,
                                    {"prefill": 6}, 0.5, {"decode": 2, "prefill": 3}), at=10.0)
    obs = observe(b, a)
    assert obs.window_s == 10.0 and obs.finished == 20 and obs.arrived == 22
    assert obs.arrival_rate == pytest.approx(2.2)
    assert obs.mean_isl == 200 and obs.mean_osl == 50
    assert obs.ttft.count == 20 and obs.ttft.mean == pytest.approx(2.0)
    assert obs.ttft.share_within(1.0) == 0.0 and obs.itl.share_within(0.1) == 1.0
    assert obs.workers == {"decode": 2, "prefill": 3} and obs.waiting["prefill"] == pytest.approx(6)
    assert obs.kv_usage["decode"] == pytest.approx(0.5)


def _obs(rate: float, isl: int, osl: int, ttft: float, itl: float, workers: dict[str, int], waiting=None,  # noqa: ANN001
         usage: float = 0.0):
    n = int(rate * 10)
    a = parse_metrics(_metrics_text(0, 0, [], [], 0, 0, {}, 0.0, workers), at=0.0)
    b = parse_metrics(_metrics_text(n, 0, [ttft] * n, [itl] * n * 10, n * isl, n * osl, waiting or {}, usage,
                                    workers), at=10.0)
    return observe(b, a)


def test_the_sla_policy_moves_workers_to_the_phase_that_needs_them() -> None:
    policy = SlaPolicy(CostModel(load_profile(DEFAULT_PROFILE)), ttft_slo_s=1.0, itl_slo_s=0.01,
                       remote_prefill_threshold=0)
    heavy_prefill = policy.propose(_obs(20, 4096, 64, 0.9, 0.007, {"prefill": 4, "decode": 4}), {"prefill": 4, "decode": 4})
    policy2 = SlaPolicy(CostModel(load_profile(DEFAULT_PROFILE)), ttft_slo_s=1.0, itl_slo_s=0.01,
                        remote_prefill_threshold=0)
    heavy_decode = policy2.propose(_obs(40, 256, 1024, 0.1, 0.008, {"prefill": 4, "decode": 4}), {"prefill": 4, "decode": 4})
    assert heavy_prefill.counts["prefill"] > heavy_decode.counts["prefill"]
    assert heavy_decode.counts["decode"] > heavy_prefill.counts["decode"]
    assert heavy_prefill.counts["prefill"] == 4 and heavy_prefill.counts["decode"] <= 2
    assert heavy_decode.counts["decode"] >= 5 and heavy_decode.counts["prefill"] <= 2
    assert "req/s" in heavy_prefill.reason and heavy_prefill.figures["rate_rps"] == pytest.approx(20)


def test_the_load_policy_follows_queues_and_kv_usage() -> None:
    p = LoadPolicy()
    up = p.propose(_obs(1, 100, 10, 0.1, 0.01, {"prefill": 2, "decode": 2}, {"prefill": 10}, usage=0.95),
                   {"prefill": 2, "decode": 2})
    assert up.counts == {"prefill": 3, "decode": 3} and "prefill queue" in up.reason
    down = p.propose(_obs(1, 100, 10, 0.1, 0.01, {"prefill": 2, "decode": 2}, {}, usage=0.1), {"prefill": 2, "decode": 2})
    assert down.counts == {"prefill": 1, "decode": 1}


class FakeScaler:
    def __init__(self, prefill: int, decode: int) -> None:
        self.n = {"prefill": prefill, "decode": decode}
        self.calls: list[tuple[str, int]] = []
        self.fail_next = False
        self.peak = prefill + decode

    def count(self, role: str) -> int:
        return self.n[role]

    async def scale(self, role: str, n: int) -> None:
        self.calls.append((role, n))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("decode-3 died while starting")
        self.n[role] = n
        self.peak = max(self.peak, sum(self.n.values()))


class Scripted:
    """A policy that proposes what the test says, in turn."""

    def __init__(self, wants: list[dict[str, int]]) -> None:
        self.wants = wants

    def propose(self, obs, current):  # noqa: ANN001, ANN201
        from shared.planner.policy import Proposal

        return Proposal(self.wants.pop(0), "scripted", {"x": 1.0})


def _planner(wants, scaler, **cfg):  # noqa: ANN001, ANN003, ANN202
    t = iter(range(1000))

    async def read() -> Snapshot:
        return Snapshot(at=float(next(t)))

    return Planner(PlannerConfig(mode="load", limits=limits(pmax=6, dmax=6), **cfg), Scripted(wants), scaler, read)


def test_hysteresis_budget_and_one_step_at_a_time() -> None:
    async def go() -> None:
        scaler = FakeScaler(6, 2)
        pl = _planner([{"prefill": 2, "decode": 6}] * 4 + [{"prefill": 3, "decode": 5}] + [{"prefill": 1, "decode": 5}] * 2,
                      scaler, budget=8)
        assert await pl.tick() is None  # nothing to compare with yet
        d = await pl.tick()
        # Decode wants to grow and the budget is full: prefill shrinks by one at once (a rebalance), drained
        # before decode grows into the room it leaves; one step each.
        assert d.applied == {"prefill": 5, "decode": 3} and scaler.calls == [("prefill", 5), ("decode", 3)]
        for _ in range(3):
            await pl.tick()
        assert scaler.n == {"prefill": 2, "decode": 6} and scaler.peak <= 8
        d = await pl.tick()  # one more prefill and one fewer decode: a rebalance, at once
        assert d.applied == {"prefill": 3, "decode": 5} and d.reason == "scripted"
        d = await pl.tick()  # an idle role alone shrinks only after down_after intervals: no flapping
        assert d.applied == {"prefill": 3, "decode": 5}
        d = await pl.tick()
        assert d.applied == {"prefill": 2, "decode": 5}
    asyncio.run(go())


def test_a_failed_scale_is_recorded_and_the_planner_goes_on() -> None:
    async def go() -> None:
        scaler = FakeScaler(1, 1)
        pl = _planner([{"prefill": 1, "decode": 3}] * 3, scaler)
        await pl.tick()
        scaler.fail_next = True
        d = await pl.tick()
        assert "died while starting" in d.outcome and scaler.n["decode"] == 1
        d = await pl.tick()
        assert d.outcome == "ok" and scaler.n["decode"] == 2
        endpoint = PlannerEndpoint(pl)
        url = await endpoint.start()
        try:
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/decisions", timeout=5).read())
            got = json.loads(body)
            assert got["counts"] == {"prefill": 1, "decode": 2}
            assert [x["outcome"] != "ok" for x in got["decisions"]] == [True, False]
            text = (await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/metrics", timeout=5).read())).decode()
            assert 'kvmesh:planner_workers{role="decode"} 2.0' in text
            assert 'kvmesh:planner_scale_errors_total{role="decode"} 1.0' in text
        finally:
            await endpoint.stop()
    asyncio.run(go())


WORKER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("up", flush=True)
if sys.argv[1] == "die":
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


def test_the_supervisor_scaler_starts_and_drains_processes_and_survives_a_dying_one() -> None:
    async def go() -> None:
        lines: list[str] = []
        sup = Supervisor(lines.append)
        dying = {2}

        def process_for(role: str, i: int) -> ProcessSpec:
            return ProcessSpec(f"{role}-{i}", (sys.executable, "-c", WORKER, "die" if i in dying else "live"))

        await sup.start(process_for("decode", 0))
        scaler = SupervisorScaler(sup, process_for, {"decode": [0], "prefill": []}, {"decode": 3, "prefill": 0},
                                  drain_timeout_s=5)
        await scaler.scale("decode", 3)  # decode-2 dies at once: the supervisor restarts it, the scale stands
        assert scaler.count("decode") == 3 and scaler.names("decode") == ["decode-0", "decode-1", "decode-2"]
        with pytest.raises(RuntimeError, match="no bus identity"):
            await scaler.scale("decode", 4)
        for _ in range(100):  # decode-2 dies; the supervisor restarts it
            if sup.children["decode-2"].starts >= 2:
                break
            await asyncio.sleep(0.1)
        assert sup.children["decode-2"].last_exit == 3 and scaler.count("decode") == 3
        dying.clear()
        await scaler.scale("decode", 1)
        assert scaler.names("decode") == ["decode-0"] and set(sup.children) == {"decode-0"}
        await scaler.scale("decode", 2)  # decode-1 again, under its old name
        assert set(sup.children) == {"decode-0", "decode-1"}
        await sup.stop(list(sup.children), timeout=5)
        assert any("decode-2 exited with code 3" in line for line in lines)
    asyncio.run(go())
