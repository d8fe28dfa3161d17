"""`kvmesh bench spec` runs end to end on the real model and writes its JSON (slow: a benchmark)."""
from __future__ import annotations

import json

import pytest

from loadtest.cli import main


@pytest.mark.slow
def test_bench_spec_writes_every_cell(smollm2_dir, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(smollm2_dir), "--methods", "off,ngram", "--concurrency", "1",
                 "--max-tokens", "8", "--requests", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for workload in ("grounded", "chat"):
        cell = report["results"][workload]["1"]
        assert cell["off"]["output_tokens"] > 0 and cell["off"]["mean_acceptance_length"] is None
        assert "tok_s_vs_off" in cell["ngram"]
