"""Two checkouts' CPU engines side by side: the same model and workload in one long-lived process per tree, driven in
turn (A B B A ...), so a VM whose speed drifts by 2x within a minute slows both alike; per round the ratio, then the
median. What a change to the C++ kernels needs (each tree builds its own extension).

`python -m loadtest.experiments.cpu_engine.tree_ab --base DIR [--model PATH] [--quantization auto] [--prompt-len 10]
 [--batches 1,8] [--out 32] [--rounds 6] [--isa avx2] [--json PATH]`

The tree this file is in is B ("new"), --base is A. Model: a GGUF or checkpoint directory (default the demo's
SmolLM2 Q4_1), served as `kvmesh up` does (--quantization auto). Per round and batch: `batch` fresh prompts of
--prompt-len tokens (distinct: no prefix-cache hit), the prefill step timed apart, then --out decode steps.
--isa avx2 builds and runs both trees' kernels as on an AVX2-only CPU (and caps torch, oneDNN and MKL there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from loadtest.experiments.llamacpp.cpu_vs_llamacpp import isa_env
from loadtest.report_json import emit_report, provenance
from shared.engine.cpu_threads import openmp_env

HERE = Path(__file__).resolve().parents[3]

# A child: loads the engine once, then answers "batch out round" lines with one JSON line.
CHILD = r"""
import json, sys, time
import torch
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.models.model_source import resolve_model
from shared.sampling_params import SamplingParams
model, plen, quantization = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = LLMEngine(EngineConfig(model=str(resolve_model(model)), quantization=quantization))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    batch, out, rnd = (int(v) for v in line.split())
    params = SamplingParams(temperature=0.0, max_tokens=out + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{rnd}-{batch}-{i}", [100 + (i * 7 + j * 13 + rnd * 101 + batch * 37) % 4000
                                                 for j in range(plen)], params)
    t = time.perf_counter()
    engine.step()
    first = time.perf_counter() - t
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    print(json.dumps({"prefill_ms": first * 1e3, "tok_s": batch * len(steps) / sum(steps)}), flush=True)
"""

class Arm:
    def __init__(self, tree: Path, model: str, plen: int, quantization: str, env: dict[str, str]) -> None:
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, model, str(plen), quantization], cwd=tree, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **env, "PYTHONPATH": str(tree)})
        if json.loads(self.proc.stdout.readline()).get("ready") is not True:
            raise RuntimeError(f"{tree}: the engine did not start")

    def run(self, batch: int, out: int, rnd: int) -> dict:
        self.proc.stdin.write(f"{batch} {out} {rnd}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.tree}: the engine process ended")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other checkout (A)")
    ap.add_argument("--model", default="")
    ap.add_argument("--prompt-len", type=int, default=10)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quantization", default="auto", help="as `kvmesh up --quantization` (none: 16-bit weights)")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model
    if not model:
        from shared.models.smollm2 import smollm2_gguf

        model = str(smollm2_gguf())
    env = {**openmp_env(os.environ), **isa_env(None if args.isa == "native" else args.isa)}
    batches = [int(b) for b in args.batches.split(",")]
    arms = {"A": Arm(Path(args.base).resolve(), model, args.prompt_len, args.quantization, env),
            "B": Arm(HERE, model, args.prompt_len, args.quantization, env)}
    runs: dict[str, dict[int, list[dict]]] = {k: {b: [] for b in batches} for k in arms}
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms both up
            for b in batches:
                for k in ("AB" if rnd % 2 else "BA"):
                    r = arms[k].run(b, args.out, rnd)
                    if rnd:
                        runs[k][b].append(r)
    finally:
        for a in arms.values():
            a.close()
    table = {}
    for b in batches:
        a, n = runs["A"][b], runs["B"][b]
        table[str(b)] = {
            "A_tok_s_median": round(statistics.median(r["tok_s"] for r in a), 2),
            "B_tok_s_median": round(statistics.median(r["tok_s"] for r in n), 2),
            "B_over_A_decode": round(statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(a, n)), 3),
            "A_prefill_ms_median": round(statistics.median(r["prefill_ms"] for r in a), 1),
            "B_prefill_ms_median": round(statistics.median(r["prefill_ms"] for r in n), 1),
            "B_over_A_prefill_time": round(statistics.median(y["prefill_ms"] / x["prefill_ms"]
                                                             for x, y in zip(a, n)), 3),
        }
    emit_report({**provenance(), "A": tree_state(Path(args.base).resolve()), "B": tree_state(HERE), "model": model,
                 "quantization": args.quantization, "isa": args.isa,
                 "prompt_len": args.prompt_len, "out": args.out, "rounds": args.rounds, "batches": table,
                 "runs": runs}, args.json)


def tree_state(tree: Path) -> dict:
    """The checkout's commit, and whether it had uncommitted changes (the figures are then of those)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True).stdout.strip()

    return {"tree": str(tree), "commit": git("rev-parse", "HEAD") or None,
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no"))}


if __name__ == "__main__":
    main()
