"""The GPU check's quant step, on this CPU: its plan has the offline tok/s rows and the decode ms/step rows at batch
1 and 64 for bf16, FP8 and AWQ; its tables come from the benches' JSON; a real `kvmesh bench decode --quantization
awq` (the tiny bench model, 4-bit through the twin) writes the rows the step reads."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest import gpu_check_quant as gq


def test_the_plan_has_decode_rows_at_batch_1_and_64_for_each_method() -> None:
    plan = {name: argv for name, argv, _ in gq.quant_plan(smoke=False, fp8_ok=True)}
    decode = {n: a for n, a in plan.items() if n.startswith("decode ")}
    assert set(decode) == {"decode qwen3-0.6b bf16", "decode qwen3-0.6b fp8", "decode qwen3-0.6b awq"}
    for name, argv in decode.items():
        assert argv[0] == "decode" and argv[argv.index("--batch-sizes") + 1] == "1,64"
        method = name.rsplit(" ", 1)[1]
        assert ("--quantization" in argv) == (method != "bf16")
        if method != "bf16":
            assert argv[argv.index("--quantization") + 1] == method
    assert {"qwen3-0.6b bf16", "llama-3.1-8b fp8", "llama-3.1-8b awq"} <= set(plan)
    no_fp8 = [n for n, _, _ in gq.quant_plan(smoke=False, fp8_ok=False)]
    assert not any("fp8" in n for n in no_fp8) and "decode qwen3-0.6b awq" in no_fp8


def test_the_step_tabulates_what_the_benches_wrote(tmp_path: Path) -> None:
    seen = []

    def bench(args, argv, out):  # noqa: ANN001, ANN202 - the step's bench callable
        seen.append(argv)
        if argv[0] == "decode":
            ms = {"bf16": 1.0, "fp8": 0.75, "awq": 0.5}[argv[-1] if "--quantization" in argv else "bf16"]
            result = {"steps": [{"batch": b, "ms_per_step": ms * b} for b in gq.DECODE_BATCHES_SMOKE]}
        else:
            result = {"kvmesh_tok_s": 100.0}
        return {"ok": True, "command": " ".join(argv), "result": result}

    out = gq.step_quant(SimpleNamespace(smoke=True, device="cpu", out=str(tmp_path)), bench, fp8_ok=True)
    assert out["ok"] and all(a[1:3] == ["--device", "cpu"] for a in seen)
    assert out["decode_ms_per_step"] == {"decode bench bf16": {"1": 1.0, "2": 2.0},
                                         "decode bench fp8": {"1": 0.75, "2": 1.5},
                                         "decode bench awq": {"1": 0.5, "2": 1.0}}
    assert out["tok_s"] == {"bench bf16": 100.0, "bench fp8": 100.0, "bench awq": 100.0}
    assert "decode bench awq 0.50 / 1.00 ms/step at batch 1/2" in out["summary"]


@pytest.mark.slow  # minutes on two busy cores: the 4-bit twin dequantizes every weight at every step
def test_a_real_4bit_decode_bench_gives_the_rows(tmp_path: Path) -> None:
    from loadtest.cli import main

    name, argv, file = next(p for p in gq.quant_plan(smoke=True, fp8_ok=True) if p[0] == "decode bench awq")
    out = tmp_path / file
    assert main(["bench", argv[0], "--device", "cpu", *argv[1:], "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"]["quantization"] == "awq"
    row = gq.decode_table({name: {"result": result}})[name]
    assert set(row) == {"1", "2"} and all(ms > 0 for ms in row.values())
