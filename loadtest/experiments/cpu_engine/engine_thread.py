"""What the thread an engine computes on costs (issue 27): decode tok/s of the same engine, driven three ways.

`python -m loadtest.experiments.cpu_engine.engine_thread [--json PATH] [--batches 1,8] [--rounds 2]`, SmolLM2-135M-Instruct in the
CPU's default dtype, prompts of 50 tokens, 64 output tokens (ignore_eos). Each way runs in its own process
(an OpenMP team, once made, stays for the process's life), in turns:
- main:     LLMEngine.generate on the main thread (the in-process baseline);
- worker:   what an engine worker does: an asyncio loop on the main thread, EngineThread building the engine
            and stepping it (shared/engine/engine_thread.py), requests added as commands;
- poisoned: the same, after the main thread ran one parallel torch op (a 4M-element sum). This is what any
            torch op on a worker's event loop does to every later step; it must stay slower than `worker`
            by a clear margin, or this benchmark no longer shows the effect it guards against.
Ratios against `main` go to the JSON; `worker` should be about 1.0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import asyncio, json, sys, time, torch
from loadtest.report_json import emit_report
from shared.config import EngineConfig
from shared.engine.engine_thread import EngineThread
from shared.engine.llm_engine import LLMEngine
from shared.models.smollm2 import smollm2_checkpoint
from shared.sampling_params import SamplingParams

mode, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
cfg = EngineConfig(model=str(smollm2_checkpoint()))
OUT = 64
prompts = lambda b: [[100 + (i * 7 + j) % 4000 for j in range(50)] for i in range(b)]
params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)

def in_process():
    engine = LLMEngine(cfg)
    engine.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    res = {}
    for b in batches:
        t = time.perf_counter()
        engine.generate(prompts(b), params, use_tqdm=False)
        res[b] = b * OUT / (time.perf_counter() - t)
    return res

async def through_thread():
    loop = asyncio.get_running_loop()
    finished = {}
    def on_step(outputs, events, extra):
        for o in outputs:
            if o.finished:
                finished[o.request_id].set_result(None)
    thread = EngineThread(loop, on_step)
    await thread.start(lambda: LLMEngine(cfg))
    async def run(tag, b, p):
        futs = []
        for i, prompt in enumerate(prompts(b)):
            rid = f"{tag}-{i}"
            finished[rid] = loop.create_future()
            futs.append(finished[rid])
            await thread.call(lambda e, rid=rid, prompt=prompt: e.add_request(rid, prompt, p))
        await asyncio.gather(*futs)
    await run("warm", 1, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    res = {}
    for b in batches:
        t = time.perf_counter()
        await run(f"b{b}", b, params)
        res[b] = b * OUT / (time.perf_counter() - t)
    thread.stop()
    return res

if mode == "poisoned":
    torch.randn(4_000_000).sum()  # one parallel op on the main thread: its OpenMP team now exists
res = in_process() if mode == "main" else asyncio.run(through_thread())
print(json.dumps({str(k): v for k, v in res.items()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root))
    runs: dict[str, list[dict[str, float]]] = {"main": [], "worker": [], "poisoned": []}
    for _ in range(args.rounds):
        for mode in runs:
            proc = subprocess.run([sys.executable, "-c", CHILD, mode, args.batches], env=env, cwd=root,
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            out = proc.stdout.strip().splitlines()[-1]
            runs[mode].append(json.loads(out))
            print(mode, out, flush=True)
    best = {m: {b: round(max(r[b] for r in rs), 2) for b in rs[0]} for m, rs in runs.items()}
    report = {"model": "SmolLM2-135M-Instruct", "decode_tok_s_best": best,
              "ratio_vs_main": {m: {b: round(best[m][b] / best["main"][b], 3) for b in best[m]} for m in best},
              "loadavg_1m_after": os.getloadavg()[0], "cores": os.cpu_count(), "runs": runs}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
