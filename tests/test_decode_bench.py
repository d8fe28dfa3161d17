"""`kvmesh bench decode`: every timed batch is full, also when filling it takes more steps than are timed (the
first requests decode while the last still prefill, and must not finish first)."""
from __future__ import annotations

import json

from loadtest.decode_bench import fill_steps
from loadtest.cli import main


def test_a_batch_that_takes_many_steps_to_fill_is_timed_whole(tmp_path):
    out = tmp_path / "decode.json"
    # 40 prompts of 256 tokens against 2048 tokens a step: 5+ steps to fill, more than the 2 timed ones.
    rc = main(["bench", "decode", "--shape", "bench", "--device", "cpu", "--batch-sizes", "40", "--context-len", "256",
               "--steps", "2", "--attn-batch", "2", "--attn-context", "64", "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["steps"]
    assert row["batch"] == 40 and row["ms_per_step"] > 0


def test_fill_steps_cover_the_prefill_and_the_decodes_sharing_it():
    assert fill_steps(1, 512, 2048) >= 2
    assert fill_steps(256, 512, 2048) >= 2 * 64
