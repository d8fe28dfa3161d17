"""Smoke tests of the offline benchmarks: both commands run end to end on a tiny model and write
the JSON keys issue 2 names. Speed is not checked here; the full-size runs are by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workload import TINY_SHAPE, build_bench_model
from shared.cli import main

OFFLINE_KEYS = ("kvmesh_tok_s", "hf_batched_tok_s", "hf_unbatched_tok_s", "hf_continuous_tok_s",
                "ratio_vs_hf_batched", "ratio_vs_hf_continuous")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_bench_model(str(tmp_path_factory.mktemp("bench-model")), TINY_SHAPE, seed=0)


def test_bench_offline_writes_all_figures(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", tiny_model, "--json", str(out), "--num-prompts", "6",
               "--input-len-min", "8", "--input-len-max", "48", "--output-len-min", "4", "--output-len-max", "16",
               "--hf-batch-size", "4", "--hf-unbatched-requests", "2", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "128", "--kv-cache-bytes", str(16 << 20)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in OFFLINE_KEYS:
        assert report[key] is not None and report[key] > 0, key
    assert report["workload"]["num_prompts"] == 6
    assert report["machine"]["torch"]
    # Same weights, greedy, float32: the first request must match transformers token for token.
    assert report["correctness"]["kvmesh_first_request_equal"] is True


def test_bench_prefix_reports_cache_hits(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", tiny_model, "--json", str(out), "--prompt-len", "200",
               "--shared-len", "180", "--num-warm", "2", "--max-num-batched-tokens", "256",
               "--kv-cache-bytes", str(16 << 20)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("ttft_cold_s", "ttft_warm_s", "ratio"):
        assert report[key] > 0, key
    assert report["cold_cached_tokens"] == 0
    assert min(report["warm_cached_tokens"]) > 0
    assert min(report["warm_cached_tokens"]) == report["expected_cached_tokens"] == 176
