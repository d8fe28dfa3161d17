"""`kvmesh bench serve` reports speculative decoding's acceptance from the server's /metrics: against a real mesh
whose decode worker speculates (ngram, prompts that repeat themselves), the parser on vLLM's own exposition, and
null fields (no error) for a server without /metrics."""
from __future__ import annotations

import asyncio
import json

import httpx

from loadtest.serve.spec_metrics import SpecCounters, SpecDecodeSummary, metrics_url, parse_spec_counters, scrape
from loadtest.cli import main
from tests.gateway_harness import Mesh
from tests.test_spec_decode import NGRAM, repetitive_prompts

# Written by hand in the format vLLM exports (ngram, num_speculative_tokens=3; its metric names, types and labels),
# not captured from a running vLLM: no vLLM server can run here. Trimmed to the spec lines and a neighbour.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 400.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7569e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1200.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 600.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-0.6B",position="0"} 300.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-0.6B",position="1"} 200.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-0.6B",position="2"} 100.0
"""


def test_parses_vllm_exposition_and_derives_vllm_figures():
    c = parse_spec_counters(VLLM_METRICS)
    assert c == SpecCounters(400.0, 1200.0, 600.0, {0: 300.0, 1: 200.0, 2: 100.0})
    before = SpecCounters(100.0, 300.0, 100.0, {0: 60.0, 1: 30.0, 2: 10.0})
    s = SpecDecodeSummary.of(before, c)
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (300, 900, 500)
    assert s.spec_mean_acceptance_length == 1 + 500 / 300
    assert s.spec_draft_acceptance_rate == 500 / 900
    assert s.spec_acceptance_rate_per_pos == [240 / 300, 170 / 300, 90 / 300]
    # Two engines (data parallel) add up; a server with other metrics only has none.
    lines = []
    for ln in VLLM_METRICS.splitlines():
        lines += [ln, ln.replace('engine="0"', 'engine="1"')] if 'engine="0"' in ln else [ln]
    two = "\n".join(lines) + "\n"
    assert parse_spec_counters(two) == SpecCounters(800.0, 2400.0, 1200.0, {0: 600.0, 1: 400.0, 2: 200.0})
    assert parse_spec_counters(VLLM_METRICS.split("# HELP vllm:spec")[0]) is None
    assert SpecDecodeSummary.of(None, None).to_json() == {k: None for k in SpecDecodeSummary().to_json()}


def test_metrics_url_and_a_server_without_metrics():
    assert metrics_url("http://h:1/v1/") == metrics_url("http://h:1") == "http://h:1/metrics"
    assert asyncio.run(scrape("http://127.0.0.1:9")) is None  # nothing listens: None, no error


def test_bench_serve_reports_acceptance_from_a_speculating_mesh(checkpoints, tmp_path, capsys):
    ckpt = checkpoints["llama"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "output_len": 24}) + "\n"
                               for p in repetitive_prompts([30, 26, 34], seed=5)))
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        # A short beat: the gateway's counters trail the worker by one beat, --metrics-settle covers it.
        mesh.start_decoder("d0", speculative_config=NGRAM, beat_interval_s=0.2)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        out = tmp_path / "serve.json"
        # No warm-ups and a fixed EOS mode (no probe): every request the mesh sees is a measured one.
        rc = main(["bench", "serve", "--base-url", mesh.url, "--model", "tiny", "--dataset", "jsonl",
                   "--jsonl", str(prompts), "--num-prompts", "3", "--sweep-concurrency", "1,3", "--eos-mode",
                   "ignore_eos", "--num-warmups", "0", "--no-progress", "--metrics-settle", "0.6",
                   "--time-limit", "60", "--request-timeout", "30", "--json", str(out)])
        printed = capsys.readouterr().out
        assert rc == 0, printed
        metrics = parse_spec_counters(httpx.get(f"{mesh.url}/metrics", timeout=10).text)
    finally:
        mesh.close()
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and all(r["summary"]["completed"] == 3 for r in runs)
    specs = [r["spec_decode"] for r in runs]
    for s in specs:
        assert s["spec_num_drafts"] > 0 and s["spec_mean_acceptance_length"] > 1
        assert s["spec_mean_acceptance_length"] == 1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
        assert s["spec_draft_acceptance_rate"] == s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
        assert 0 < s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
        rates = s["spec_acceptance_rate_per_pos"]
        assert rates and all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:] + [0]))
        # Accepted tokens are the per-position acceptances summed (position i counts drafts accepted through i).
        assert abs(sum(rates) * s["spec_num_drafts"] - s["spec_num_accepted_tokens"]) < 1e-6
    # The levels partition what the server counted: the mesh saw nothing but the measured requests.
    assert sum(s["spec_num_drafts"] for s in specs) == metrics.num_drafts
    assert sum(s["spec_num_draft_tokens"] for s in specs) == metrics.num_draft_tokens
    assert sum(s["spec_num_accepted_tokens"] for s in specs) == metrics.num_accepted_tokens
    assert "Mean acceptance length" in printed and "accept len" in printed
