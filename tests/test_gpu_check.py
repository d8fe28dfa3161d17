"""`make gpu-check`'s script (loadtest/gpu_check.py) in its CPU smoke mode: each step in its own process under
one total budget, every finished case appended at once, a summary and one archive even when a step is cut; a
failing or overrunning step does not stop the next."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

import loadtest.gpu_check as gc
from loadtest import gpu_check_steps as steps
from loadtest.gpu_kernel_cases import kernel_cases


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
    kernels = steps.read_cases(tmp_path, "kernels")
    assert len(kernels) == json.loads((tmp_path / "kernels.json").read_text())["cases_planned"]
    assert {c["kernel"] for c in kernels} >= {"rms_norm", "rotary", "store_kv", "qk_rope_store", "silu_mul",
                                                       "decode_attention", "extend_attention", "token_bitmask"}
    assert any(c["kv"] == "fp8" for c in kernels)
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert decode["command"].startswith("kvmesh bench decode") and decode["result"]


@pytest.mark.slow
def test_every_step_in_smoke_mode(tmp_path):
    proc, summary = _run(tmp_path, "--total-budget", "900")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert summary["passed"] == len(gc.STEPS)
    assert set(summary) >= {"kernels", "greedy", "graphs", "memory", "speed"}
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


def test_smollm2_travels_in_pieces_and_is_checked(tmp_path):
    """loadtest/gpu_stage.py: the GGUF split here, stashed there call by call, joined with its SHA-256 checked."""
    from loadtest import gpu_stage

    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB: three pieces of 1 MiB at most
    parts = gpu_stage.split(src, tmp_path / ".gpu", part_mib=1)
    assert [p.parent.name for p in parts] == ["1", "2", "3"]
    stage = tmp_path / "stage"
    gpu_stage.stash(tmp_path / ".gpu" / "3", stage)
    gpu_stage.stash(tmp_path / ".gpu" / "1", stage)
    with pytest.raises(ValueError, match="handed back"):  # the second call's piece is missing
        gpu_stage.assemble(stage)
    gpu_stage.stash(tmp_path / ".gpu" / "2", stage)
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
    assert steps.spec_verdict(_spec_report("bfloat16", "10/10", graphs), cuda=True)["ok"]
    assert steps.spec_verdict(_spec_report("bfloat16", "9/10", graphs), cuda=True)["ok"]  # a bf16 near-tie
    assert not steps.spec_verdict(_spec_report("float32", "9/10", padded), cuda=False)["ok"]
    assert not steps.spec_verdict(_spec_report("bfloat16", "10/10", padded), cuda=True)["ok"], "no graph replayed"
    v = steps.spec_verdict(_spec_report("float32", "2/2", padded), cuda=False)
    assert v["ok"] and not v["verify_graphs_used"] and v["identical_to_off"] == "2/2"
    assert not steps.spec_verdict({}, cuda=False)["ok"]


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


def test_the_total_budget_cuts_the_last_steps_not_the_run(tmp_path):
    """The total budget runs out in the kernels step: the driver SIGKILLs the step's process group, the cases it
    finished are what its JSON says, the summary names the cut step, one archive holds everything, and a step cut
    by the budget is no failure. Not --smoke: the full kernel cases (GPU shapes under the interpreter) take minutes
    on any CPU, where a fast one finishes the smoke set inside the budget."""
    out, archive = tmp_path / "gc", tmp_path / "gc.tgz"
    proc = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--device", "cpu", "--out", str(out),
                           "--only", "env,kernels,greedy", "--total-budget", "20", "--archive", str(archive)],
                          capture_output=True, text=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert summary["cut"] == "kernels" and summary["seconds"] < 30
    assert [s["status"] for s in summary["steps"]] == ["ok", "cut", "skipped"]
    kept = steps.read_cases(out, "kernels")
    assert json.loads((out / "kernels.json").read_text())["cases_kept"] == len(kept) == summary["kernels"]["cases"]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {"gc/summary.json", "gc/kernels.log", "gc/env.json", "gc/kernels.json"} <= set(names)
    assert "not run to the end: kernels=cut, greedy=skipped" in proc.stdout


def _step_pid(driver: int) -> int | None:
    out = subprocess.run(["pgrep", "-P", str(driver)], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def test_a_step_sigkilled_mid_way_keeps_its_finished_cases(tmp_path):
    """SIGKILL to a running step (and all it started): the cases it finished stay, the summary says which step was
    cut and how, the next step still runs, and the archive is written."""
    out, archive = tmp_path / "gc", tmp_path / "gc.tgz"
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.gpu_check", "--device", "cpu", "--smoke", "--out",
                             str(out), "--only", "kernels,greedy", "--archive", str(archive)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(steps.read_cases(out, "kernels")) < 2 and time.time() < deadline:
        time.sleep(0.1)
    step = _step_pid(proc.pid)
    assert step is not None
    os.killpg(step, signal.SIGKILL)  # the step runs in its own process group: its shards go too
    stdout, stderr = proc.communicate(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1, stdout + stderr[-2000:]
    assert summary["cut"] == "kernels"
    assert [s["status"] for s in summary["steps"]] == ["killed by SIGKILL", "ok"]
    kept = steps.read_cases(out, "kernels")
    assert len(kept) >= 2 and all(c["ok"] for c in kept)
    assert json.loads((out / "kernels.json").read_text())["cases_kept"] == len(kept)
    with tarfile.open(archive) as tar:
        assert "gc/kernels.jsonl" in tar.getnames()


def test_sigterm_ends_the_running_step_and_still_writes_the_summary(tmp_path):
    """`timeout` sends SIGTERM: the running step and everything it started are killed, the summary says so and
    the archive is written."""
    out, archive = tmp_path / "gc", tmp_path / "gc.tgz"
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.gpu_check", "--device", "cpu", "--smoke", "--out",
                             str(out), "--only", "kernels,greedy", "--archive", str(archive)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not steps.read_cases(out, "kernels") and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 1
    assert summary["cut"] == "kernels" and summary["interrupted_by"] == "SIGTERM"
    assert [s["status"] for s in summary["steps"]] == ["cut", "skipped"]
    assert archive.exists() and steps.read_cases(out, "kernels")
    shards = subprocess.run(["pgrep", "-f", f"--out {out} --shard"], capture_output=True, text=True).stdout
    assert not shards.strip(), "the kernels step's shard processes outlived it"


def test_kernel_cases_are_the_same_in_every_process_and_shards_split_them():
    a = kernel_cases("cpu", smoke=False, fp8=True)
    b = kernel_cases("cpu", smoke=False, fp8=True)
    assert [c.key for c in a] == [c.key for c in b] and len({c.key for c in a}) == len(a)
    shards = [a[i::3] for i in range(3)]
    assert sorted(c.key for s in shards for c in s) == sorted(c.key for c in a)
    assert {c.dtype for c in a} == {"bfloat16", "float16", "float32"} and any(c.kv == "fp8" for c in a)
    assert not any(c.kv == "fp8" for c in kernel_cases("cpu", smoke=False, fp8=False))


def test_a_case_builds_the_same_inputs_from_its_name():
    case = next(c for c in kernel_cases("cpu", smoke=True, fp8=True) if c.kernel == "rms_norm")
    got1, want1, _ = case.run()
    got2, want2, _ = case.run()
    assert (want1 == want2).all() and (got1 == got2).all()


def test_bf16_divergence_is_judged_by_the_margin_at_the_first_differing_token():
    from shared.token_logprobs import TokenLogprobs

    def run(ids, tops):
        return ids, [TokenLogprobs(t, top[0][1], top) for t, top in zip(ids, tops)]
    tops = [[(5, -1.0), (6, -1.02)], [(7, -0.5), (8, -3.0)]]
    ref = run([5, 7], tops)
    assert steps.divergence_margins([ref], [run([5, 7], tops)]) == []
    assert steps.divergence_margins([ref], [run([6, 9], tops)]) == [pytest.approx(0.02)]  # a near-tie
    assert steps.divergence_margins([ref], [run([5, 8], tops)]) == [pytest.approx(2.5)]  # a real difference
    assert steps.divergence_margins([ref], [run([5, 1], tops)]) == [float("inf")]  # not even in the top list
