"""The decode worker's own view of a block of requests, read from the gateway's /metrics, and mesh-over-engine
ratios of interleaved rounds: what a benchmark that compares the mesh with the engine in process reads besides
the client's clock."""
from __future__ import annotations

import statistics

# The gateway's /metrics series whose deltas give the decode worker's own view of a block of requests: its engine's
# decode time (first -> last token, the engine's clock), prefill time, tokens and steps.
WORKER_SERIES = ("kvmesh:request_decode_time_seconds_sum", "kvmesh:request_prefill_time_seconds_sum",
                 "kvmesh:request_queue_time_seconds_sum", "kvmesh:request_success_total",
                 "kvmesh:generation_tokens_total", "kvmesh:iteration_tokens_total_count",
                 "kvmesh:iteration_tokens_total_sum")


def scrape(base: str) -> dict[str, float]:
    import urllib.request

    return worker_series(urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode())


def worker_series(text: str) -> dict[str, float]:
    """WORKER_SERIES from a /metrics page, summed over models (and decode workers, for the per-worker ones)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in WORKER_SERIES and smp.labels.get("role", "decode") == "decode":
                out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def worker_view(before: dict[str, float], after: dict[str, float]) -> dict:
    """The decode worker's engine, as it timed the block's requests itself: ms per token after the first (decode
    time / (tokens - 1 per request)), prefill + queue ms per request, tokens per engine step."""
    d = {k.removeprefix("kvmesh:"): after.get(k, 0.0) - before.get(k, 0.0) for k in WORKER_SERIES}
    n, toks = d["request_success_total"], d["generation_tokens_total"]
    steps = d["iteration_tokens_total_count"]
    return {"ms_per_token": round(d["request_decode_time_seconds_sum"] * 1e3 / (toks - n), 2) if toks > n else None,
            "prefill_plus_queue_ms": round((d["request_prefill_time_seconds_sum"] + d["request_queue_time_seconds_sum"])
                                           * 1e3 / n, 1) if n else None,
            "steps": int(steps), "tokens_per_step": round(d["iteration_tokens_total_sum"] / steps, 2) if steps else None,
            "requests": int(n), "tokens": int(toks)}


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def ratios(engine_rounds: list[dict], mesh_rounds: list[dict], c: str) -> dict:
    """Mesh over engine at one concurrency, round by round (the same minutes of the machine's load), then the median:
    output tok/s, per-token speed (engine ms/token / mesh ms/token: above 1 = the mesh is faster), the worker's own
    per-token speed against the engine's, and TTFT over the engine's."""
    pairs = [(e["by_concurrency"][c]["summary"], m["by_concurrency"][c]["summary"])
             for e, m in zip(engine_rounds, mesh_rounds)]
    return {"output_tok_s": median_or_none([m["output_tok_s"] / e["output_tok_s"] for e, m in pairs]),
            "per_token": median_or_none([e["ms_per_token_median"] / m["ms_per_token_median"] for e, m in pairs]),
            "worker_per_token": median_or_none([e["ms_per_token_median"] / m["worker_ms_per_token"]
                                         if m.get("worker_ms_per_token") else None for e, m in pairs]),
            "ttft_minus_engine_ms": median_or_none([m["ttft_ms_median"] - e["ttft_ms_median"] for e, m in pairs])}
