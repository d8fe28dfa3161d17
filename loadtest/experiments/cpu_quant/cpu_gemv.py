"""Decode matmuls on a CPU without native bf16: float32 dense (F.linear on a float32 weight, what such a CPU served
before) against the C++ kernels that keep the weight compact (kernels/cpu/gemv_bf16.cpp, gemv_gguf.cpp): bf16
widened in registers, Q4 (Q4_0/Q4_1) and Q8_0 blocks with float32 activations (act f32) or int8 activations
(act q8), at SmolLM2-135M's shapes and at a 1B model's (Llama-3.2-1B: hidden 2048, intermediate 8192).

`python -m loadtest.experiments.cpu_quant.cpu_gemv [--json PATH] [--threads 1,2] [--batches 1,8] [--rounds 5]`

Arms run interleaved round after round (the machine may be shared); per arm the median microseconds per call,
and its speed against float32 dense in the same round (median of the per-round ratios). KVMESH_CPU_ISA=avx2
builds and measures the AVX2 variants on an AVX-512 CPU.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loadtest.report_json import emit_report, git_commit

SHAPES = {  # name: (in, out)
    "smollm2 gate_up 576x3072": (576, 3072),
    "smollm2 down 1536x576": (1536, 576),
    "smollm2 head 576x49152": (576, 49152),
    "1b qkv 2048x3072": (2048, 3072),
    "1b gate_up 2048x16384": (2048, 16384),
    "1b down 8192x2048": (8192, 2048),
}


def _arms(k: int, n: int) -> dict:
    from kernels.cpu import gemv_gguf as G
    from kernels.cpu.gemv_bf16 import linear_w16

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    wb = w.bfloat16()
    q4 = G.pack_q4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01,
                   -torch.rand(n, k // 32, generator=g) * 0.08)
    q8 = G.pack_q8(torch.randint(-127, 128, (n, k), generator=g).to(torch.int8), torch.rand(n, k // 32, generator=g))
    return {
        "f32 dense": lambda x: F.linear(x, w),
        "bf16": lambda x: linear_w16(x, wb),
        "Q4 act f32": lambda x: G.linear_gguf(x, *q4, None, G.Q4, G.ACT_F32),
        "Q4 act q8": lambda x: G.linear_gguf(x, *q4, None, G.Q4, G.ACT_Q8),
        "Q8_0 act f32": lambda x: G.linear_gguf(x, *q8, None, G.Q8_0, G.ACT_F32),
        "Q8_0 act q8": lambda x: G.linear_gguf(x, *q8, None, G.Q8_0, G.ACT_Q8),
    }


def _time_us(fn, x: torch.Tensor, budget_s: float) -> float:
    fn(x)
    reps, t0 = 0, time.perf_counter()
    while True:
        fn(x)
        reps += 1
        el = time.perf_counter() - t0
        if el > budget_s and reps >= 3:
            return el / reps * 1e6


def measure(threads: list[int], batches: list[int], rounds: int, budget_s: float) -> list[dict]:
    rows = []
    for name, (k, n) in SHAPES.items():
        arms = _arms(k, n)
        for t in threads:
            torch.set_num_threads(t)
            for m in batches:
                x = torch.randn(m, k)
                times: dict[str, list[float]] = {a: [] for a in arms}
                for _ in range(rounds):
                    for a, fn in arms.items():
                        times[a].append(_time_us(fn, x, budget_s))
                base = times["f32 dense"]
                rows.append({"shape": name, "threads": t, "batch": m,
                             "us": {a: round(statistics.median(v), 1) for a, v in times.items()},
                             "speedup_vs_f32": {a: round(statistics.median(b / s for b, s in zip(base, v)), 2)
                                                for a, v in times.items() if a != "f32 dense"}})
                print(rows[-1], flush=True)
    return rows


def machine() -> dict:
    from kernels.cpu.extension import cpu_flags, isa

    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "vector_flags": sorted(f for f in flags if f.startswith(
        ("avx", "fma", "f16c", "amx"))), "KVMESH_CPU_ISA": isa(), "compiler_flags": cpu_flags(),
        "load_average_at_start": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=0.05, help="seconds of calls per arm per round")
    args = ap.parse_args()
    from kernels.cpu.extension import native_status

    ok, why = native_status()
    assert ok, why
    commit = git_commit()
    report = {"command": "python -m loadtest.experiments.cpu_quant.cpu_gemv " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "torch": torch.__version__,
              "note": "shared, busy machine: absolute figures are lower bounds; compare arms within a row",
              "rows": measure([int(t) for t in args.threads.split(",")], [int(b) for b in args.batches.split(",")],
                              args.rounds, args.budget_s)}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
