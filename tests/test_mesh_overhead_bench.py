"""loadtest/worker_view.py: the decode-worker view: read from the gateway's real /metrics page (so a renamed
series fails here, not silently as None in a benchmark), and its ratios."""
from __future__ import annotations

from loadtest.worker_view import WORKER_SERIES, ratios, worker_series, worker_view
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from shared.protocol.generate import RequestTimings


def test_the_worker_view_comes_from_the_gateways_metrics() -> None:
    m = GatewayMetrics(Router(), "m")
    before = worker_series(m.render().decode())
    for decode_s in (0.127, 0.254):  # two requests of 128 tokens: 1 ms and 2 ms a token after the first
        m.model_generation_tokens.inc(128)
        m.choice_done(42, 128, 128, RequestTimings(queued_s=0.001, prefill_s=0.019, decode_s=decode_s))
        m.finished("length")
    after = worker_series(m.render().decode())
    per_request = {k for k in WORKER_SERIES if "iteration_tokens" not in k}  # the steps come from workers' beats
    assert per_request <= set(after), set(WORKER_SERIES) - set(after)
    view = worker_view(before, after)
    assert view["requests"] == 2 and view["tokens"] == 256
    assert abs(view["ms_per_token"] - 1.5) < 1e-6  # (0.127 + 0.254) s / 254 later tokens
    assert abs(view["prefill_plus_queue_ms"] - 20.0) < 1e-6


def test_ratios_pair_rounds_and_take_the_median() -> None:
    def rnd(tok_s: float, ms: float, ttft: float, worker: float | None = None) -> dict:
        s = {"output_tok_s": tok_s, "ms_per_token_median": ms, "ttft_ms_median": ttft}
        if worker is not None:
            s["worker_ms_per_token"] = worker
        return {"by_concurrency": {"8": {"summary": s}}}
    engine = [rnd(400, 20, 40), rnd(200, 40, 80), rnd(500, 16, 30)]
    mesh = [rnd(380, 21, 50, 20.5), rnd(100, 80, 100, 79), rnd(500, 16, 35, 16)]
    r = ratios(engine, mesh, "8")
    assert r["output_tok_s"] == 0.95  # 0.95, 0.5, 1.0
    assert r["per_token"] == round(20 / 21, 3)
    assert r["ttft_minus_engine_ms"] == 10
    assert r["worker_per_token"] == round(20 / 20.5, 3)
