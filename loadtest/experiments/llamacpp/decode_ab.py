"""kvmesh's engine and llama.cpp's on the same GGUF, decode and short-prefill speed measured in turn, round after
round: on a VM whose speed moves by 2x within minutes, a server-by-server comparison (cpu_vs_llamacpp) that runs
each server once for minutes compares two moments as much as two engines.

`python -m loadtest.experiments.llamacpp.decode_ab [--model GGUF] [--rounds 8] [--out 64] [--prompt 16]
 [--isa avx2] [--json PATH]`

kvmesh: one long-lived in-process engine (`kvmesh up`'s --quantization auto, the engine workers' GOMP_SPINCOUNT),
per round a fresh --prompt-token prompt (its prefill step timed) then --out tokens decoded at batch 1. llama.cpp:
`llama-bench -p PROMPT -n OUT -r 1 -t 2` on the same file, its prompt-processing and generation tok/s. The two
alternate (A B B A ...); per round the ratio, then the median. Batch 1 and the engine alone: the mesh's own cost
and concurrency are cpu_vs_llamacpp's job. --isa avx2: kvmesh's kernels built for AVX2 and
torch, oneDNN and MKL capped there; llama.cpp's AVX2 build (KVMESH_LLAMACPP_DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from loadtest.report_json import emit_report, provenance
from shared.engine.cpu_threads import openmp_env

HERE = Path(__file__).resolve().parents[3]


def llama_bench(binary: Path, model: Path, plen: int, out: int) -> dict:
    r = subprocess.run([str(binary), "-m", str(model), "-p", str(plen), "-n", str(out), "-r", "1", "-t", "2",
                        "-o", "json"], capture_output=True, text=True, check=True, timeout=600)
    rows = json.loads(r.stdout)
    got = {("pp" if row["n_prompt"] else "tg"): row["avg_ts"] for row in rows}
    return {"pp_tok_s": got["pp"], "tg_tok_s": got["tg"]}


def main() -> None:
    from loadtest.experiments.cpu_engine.tree_ab import Arm
    from loadtest.experiments.llamacpp.cpu_vs_llamacpp import KERNEL_ISA, cpu_report, isa_env
    from loadtest.serve.llamacpp import server_binary

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF (default: the demo's SmolLM2 Q4_1)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (prefill speed at a chat prompt's size)")
    ap.add_argument("--isa", choices=sorted(KERNEL_ISA))
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.model:
        from shared.models.smollm2 import smollm2_gguf

        args.model = str(smollm2_gguf())
    server = server_binary(args.isa)
    if server is None:
        raise SystemExit("build llama.cpp first: kvmesh bench llamacpp --build"
                         + (f" --isa {args.isa}" if args.isa else ""))
    bench = server.with_name("llama-bench")
    env = {**openmp_env(os.environ), **isa_env(args.isa)}
    engine = Arm(HERE, args.model, args.prompt, "auto", env)

    def kvmesh(rnd: int) -> dict:
        r = engine.run(1, args.out, rnd)
        return {"pp_tok_s": args.prompt / (r["prefill_ms"] / 1e3), "tg_tok_s": r["tok_s"]}

    runs: dict[str, list[dict]] = {"kvmesh": [], "llamacpp": []}
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms both up
            for name in (("kvmesh", "llamacpp") if rnd % 2 else ("llamacpp", "kvmesh")):
                r = kvmesh(rnd) if name == "kvmesh" else llama_bench(bench, Path(args.model), args.prompt, args.out)
                if rnd:
                    runs[name].append(r)
    finally:
        engine.close()
    table = {}
    for key in ("tg_tok_s", "pp_tok_s"):
        ours, theirs = [r[key] for r in runs["kvmesh"]], [r[key] for r in runs["llamacpp"]]
        table[key] = {"kvmesh_median": round(statistics.median(ours), 2),
                      "llamacpp_median": round(statistics.median(theirs), 2),
                      "kvmesh_over_llamacpp": round(statistics.median(a / b for a, b in zip(ours, theirs)), 3)}
    emit_report({**provenance(), "model": args.model, "prompt_tokens": args.prompt, "out": args.out,
                 "rounds": args.rounds, "cpu": cpu_report(args.isa, server), "llama_bench": str(bench),
                 "summary": table, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
