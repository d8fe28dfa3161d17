"""`kvmesh bench tiers` on a tiny model: every tier serves the prefix it was given, through the real services."""
from __future__ import annotations

import json

from loadtest.workload import TINY_SHAPE, build_bench_model
from loadtest.cli import main


def test_tiers_bench_serves_the_prefix_from_each_tier(tmp_path):
    model = build_bench_model(str(tmp_path / "m"), TINY_SHAPE)
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--model", model, "--prompt-len", "120", "--repeats", "1", "--device", "cpu",
                 "--prefixes", "3", "--uses", "2", "--prefix-len", "64", "--pool-blocks", "16",
                 "--json", str(out)]) == 0
    tiers = json.loads(out.read_text())["tiers"]
    assert list(tiers) == ["device", "host", "kvstore", "disk", "none"]
    for name in ("device", "host", "kvstore", "disk"):  # all full blocks before the last token
        assert tiers[name]["cached_tokens"] == [112], name
    assert tiers["none"]["cached_tokens"] == [0] and tiers["none"]["ratio_to_recompute"] == 1.0
    sp = json.loads(out.read_text())["shared_prefix"]
    assert sp["with_tiers"]["requests"] == sp["without_tiers"]["requests"] == 6
    # A small pool: what the device evicts, the tiers keep (the bench's real sizes measure the speedup).
    assert sp["with_tiers"]["prompt_tokens_reused"] >= sp["without_tiers"]["prompt_tokens_reused"]
    assert sp["with_tiers"]["prompt_tokens_reused"] > 0
    assert sp["speedup"] > 0
