"""`kvmesh bench disk-layout` at a tiny size: every layout writes, reads back and finds its blocks after a restart."""
from __future__ import annotations

import json

from loadtest.cli import main


def test_disk_layout_bench_measures_every_layout(tmp_path):
    out = tmp_path / "disk.json"
    assert main(["bench", "disk-layout", "--dir", str(tmp_path / "d"), "--sizes-mb", "0.02", "--total-mb", "0.7",
                 "--chain", "4", "--repeats", "1", "--direct", "off,on", "--no-drop-cache", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert {(c["layout"], c["direct"]) for c in cells} == {(x, d) for x in ("slab", "per-file", "group")
                                                           for d in (False, True)}
    for c in cells:  # the bench asserts every block read back and found at restart; here, that it timed them
        assert c["blocks_held"] == c["blocks_written"] // 2 > 0
        assert all(v > 0 for v in c["median"].values()), c
    assert result["checksum_gb_s"]["xxh3_64"] > 0 and not result["page_cache_dropped"]
    assert not list((tmp_path / "d").iterdir()), "the bench cleans up after itself"
