"""`kvmesh bench kv-transfer` on a tiny model: it runs through the real services and reports every figure."""
from __future__ import annotations

import json

from loadtest.workload import TINY_SHAPE, build_bench_model
from loadtest.cli import main


def test_kv_transfer_bench_reports_transfer_and_ttft(tmp_path):
    model = build_bench_model(str(tmp_path / "m"), TINY_SHAPE)
    out = tmp_path / "kv.json"
    assert main(["bench", "kv-transfer", "--model", model, "--prompt-len", "100", "--repeats", "1",
                 "--kv-cache-bytes", str(16 << 20), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    t = result["transfer"]
    assert t["bytes"] > 0 and t["blocks"] == 7 and t["gb_per_s"] > 0 and t["memcpy_gb_per_s"] > 0
    assert set(t["paths"]) == {"nats", "tcp", "shm", "shm-2proc", "tcp-2proc"}
    assert all(p["bytes"] == t["bytes"] and p["gb_per_s"] > 0 for p in t["paths"].values())
    ttft = result["ttft"]
    assert all(ttft[k] > 0 for k in ("ttft_local_s", "ttft_remote_s", "ttft_kvstore_s"))
    assert ttft["remote_prefills"] == 2  # warm-up round + one measured round, all remote
    assert ttft["kvstore_cached_tokens"] == [96]  # 6 full blocks (the last token is always computed)
