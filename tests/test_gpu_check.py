"""`make gpu-check`'s script (loadtest/gpu_check.py) in its CPU smoke mode: each step in its own process under
a budget, a JSON file per step, a summary line; a failing or overrunning step does not stop the next."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import loadtest.gpu_check as gc


def _run(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--device", "cpu", "--smoke", "--out",
                           str(tmp_path), *extra], capture_output=True, text=True, timeout=600)
    return proc, json.loads((tmp_path / "summary.json").read_text())


def test_smoke_steps_write_json_and_a_summary_line(tmp_path):
    # A quick subset (every step runs under -m slow): a plain step, the kernels, a benchmark through the CLI.
    proc, summary = _run(tmp_path, "--only", "env,kernels,decode")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [s["name"] for s in summary["steps"]] == ["env", "kernels", "decode"]
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu-check: 3/3 steps ok")
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert {c["kernel"] for c in kernels["cases"]} >= {"rms_norm", "rotary", "store_kv", "qk_rope_store", "silu_mul",
                                                       "decode_attention", "extend_attention", "token_bitmask"}
    assert any(c["dtype"] == "fp8" for c in kernels["cases"])
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert decode["command"].startswith("kvmesh bench decode") and decode["result"]


@pytest.mark.slow
def test_every_step_in_smoke_mode(tmp_path):
    proc, summary = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert summary["passed"] == len(gc.STEPS)
    greedy = json.loads((tmp_path / "greedy.json").read_text())
    assert set(greedy["archs"]) == {"llama", "mistral", "qwen2", "qwen3", "smollm2"}
    assert "skipped" in greedy["archs"]["smollm2"], "no real SmolLM2 here: skipped with a message"


def test_a_failing_or_overrunning_step_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "STEPS", [("no-such-step", 60, 60), ("env", 1, 1), ("env", 60, 60)])
    p = gc.argparse.ArgumentParser()
    gc.add_arguments(p)
    rc = gc.run(p.parse_args(["--device", "cpu", "--smoke", "--out", str(tmp_path)]))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 1
    assert [s["status"] for s in summary["steps"]] == ["failed", "timeout", "ok"]
    assert "KeyError" in json.loads((tmp_path / "no-such-step.json").read_text())["error"]
    assert capsys.readouterr().out.strip().endswith(f"gpu-check: 1/3 steps ok in {summary['seconds']:.0f} s; not ok: "
                                                    f"no-such-step=failed, env=timeout; JSON in {tmp_path}")


def test_smollm2_travels_in_two_pieces_and_is_checked(tmp_path):
    """loadtest/gpu_stage.py: the GGUF split here, stashed there call by call, joined with its SHA-256 checked."""
    from loadtest import gpu_stage

    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 5000)
    parts = gpu_stage.split(src, tmp_path / ".gpu", first_mib=1)  # 1 MiB, then the other 0.2 MiB
    assert [p.parent.name for p in parts] == ["1", "2"]
    stage = tmp_path / "stage"
    gpu_stage.stash(tmp_path / ".gpu" / "2", stage)
    with pytest.raises(ValueError, match="handed back"):  # the first call's piece is missing
        gpu_stage.assemble(stage)
    gpu_stage.stash(tmp_path / ".gpu" / "1", stage)
    (stage / "smollm2.part1").write_bytes(b"x" + (stage / "smollm2.part1").read_bytes()[1:])
    with pytest.raises(ValueError, match="SHA-256"):
        gpu_stage.assemble(stage)
    gpu_stage.stash(tmp_path / ".gpu" / "2", stage)
    assert gpu_stage.assemble(stage).read_bytes() == src.read_bytes()


def _spec_report(dtype: str, identical: str, steps: dict) -> dict:
    cell = {"identical_to_off": identical, "verify_steps": steps}
    off = {"identical_to_off": "2/2", "verify_steps": {"replays": 0, "padded_eager": 0, "eager": 0}}
    return {"dtype": dtype, "results": {"grounded": {"1": {"off": off, "ngram": cell}}}}


def test_spec_verdict_needs_identical_outputs_and_the_graph_path():
    graphs = {"replays": 5, "padded_eager": 0, "eager": 1}
    padded = {"replays": 0, "padded_eager": 5, "eager": 0}
    assert gc.spec_verdict(_spec_report("bfloat16", "10/10", graphs), cuda=True)["ok"]
    assert gc.spec_verdict(_spec_report("bfloat16", "9/10", graphs), cuda=True)["ok"]  # a bf16 near-tie
    assert not gc.spec_verdict(_spec_report("float32", "9/10", padded), cuda=False)["ok"]
    assert not gc.spec_verdict(_spec_report("bfloat16", "10/10", padded), cuda=True)["ok"], "no graph replayed"
    v = gc.spec_verdict(_spec_report("float32", "2/2", padded), cuda=False)
    assert v["ok"] and not v["verify_graphs_used"] and v["identical_to_off"] == "2/2"
    assert not gc.spec_verdict({}, cuda=False)["ok"]


@pytest.mark.slow
def test_spec_step_in_smoke_mode(tmp_path):
    """The spec step on the CPU: kvmesh bench spec on a small Qwen3-shaped random checkpoint, off vs ngram, suffix
    and draft_model, verify steps through the padded bucket path, outputs identical to off."""
    proc, summary = _run(tmp_path, "--only", "spec")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["verify_steps"]["padded_eager"] > 0 and spec["verify_steps"]["replays"] == 0
    a, b = spec["identical_to_off"].split("/")
    assert a == b and int(b) > 0
    assert set(spec["result"]["methods"]) == {"off", "ngram", "suffix", "draft_model"}
