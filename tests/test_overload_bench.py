"""`kvmesh bench overload`'s accounting: the engines' state read back from the gateway's real /metrics text, and
the outcomes' summary."""
from __future__ import annotations

from loadtest.overload_bench import engines, summarize
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from shared.protocol.events import LoadBeat


def test_engines_state_from_the_gateways_metrics() -> None:
    router = Router()
    m = GatewayMetrics(router, "smollm2")
    router.on_beat(LoadBeat(worker_id="decode-0", running=2, waiting=3, free_blocks=90, total_blocks=100))
    m.prefill_workers.on_beat(LoadBeat(worker_id="prefill-0", role="prefill", running=0, waiting=0, free_blocks=64,
                                       total_blocks=64))
    state = engines(m.render().decode())
    assert state["decode-0"] == {"role": "decode", "running": 2.0, "waiting": 3.0, "blocks_held": 10,
                                 "pool_blocks": 100}
    assert state["prefill-0"]["blocks_held"] == 0 and state["prefill-0"]["running"] == 0


def test_summary_counts_each_outcome_once() -> None:
    results = [{"outcome": "answered", "e2e_s": 2.0, "ttft_s": 0.5}, {"outcome": "answered", "e2e_s": 4.0, "ttft_s": 1.0},
               {"outcome": "refused", "status": 429, "code": "server_overloaded"},
               {"outcome": "cancelled"}, {"outcome": "lost", "why": "no answer within 60s"}]
    s = summarize(results)
    assert (s["answered"], s["refused"], s["cancelled"], s["lost"]) == (2, 1, 1, 1)
    assert s["refusals"] == {"429 server_overloaded": 1} and s["lost_why"] == {"no answer within 60s": 1}
    assert s["e2e_s"]["max"] == 4.0 and s["ttft_s"]["p50"] in (0.5, 1.0)
