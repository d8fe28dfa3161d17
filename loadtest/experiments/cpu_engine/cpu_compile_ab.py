"""CPU decode eager vs compiled (shared/engine/cpu_compile.py), in one process, interleaved.

`python -m loadtest.experiments.cpu_engine.cpu_compile_ab [--json PATH] [--rounds 5] [--batches 1,8,32] [--threads N]`: SmolLM2-135M-Instruct
in bfloat16 (packed linears), prompts of ~50 tokens, 64 output tokens each (ignore_eos), engine in process. Both
engines are built once (the compiled one's start-up compile time is reported) and measured in turns (A, B, A,
B, ...) so drift on a shared machine hits both; the ratio is the median of the per-round ratios. It also checks
the two engines' greedy tokens on the same prompts.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from loadtest.experiments.cpu_engine.engine_ab import decode_prompts, decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--arms", default="eager,compiled", help="eager, compiled (--cpu-compile on: one layer's graph "
                    "per layer), whole (--cpu-compile whole: the whole forward in one graph)")
    ap.add_argument("--quantization", default="none", help="none, or gguf (the Q4_1 GGUF's weights as stored)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.models.smollm2 import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    batches = [int(b) for b in args.batches.split(",")]
    engines, build_s = {}, {}
    modes = {"eager": "off", "compiled": "on", "whole": "whole"}
    arms = args.arms.split(",")
    for name in arms:
        t = time.perf_counter()
        engines[name] = LLMEngine(EngineConfig(model=model, dtype="bfloat16", device="cpu", max_num_seqs=max(batches),
                                               cpu_compile=modes[name], quantization=args.quantization))
        build_s[name] = round(time.perf_counter() - t, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    toks = {n: [o.output_token_ids for o in e.generate(decode_prompts(8), greedy, use_tqdm=False)] for n, e in engines.items()}
    runs = interleaved(engines, batches, args.rounds, lambda name, b: decode_tok_s(engines[name], b, args.out_len))
    ratio = {f"{a}_vs_eager": median_ratio(runs, a, "eager") for a in arms if a != "eager"}
    report = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "quantization": args.quantization,
              "threads": torch.get_num_threads(),
              "machine": f"{os.cpu_count()} cores, shared with other jobs (load average below)",
              "loadavg_1m_after": os.getloadavg()[0], "build_s": build_s,
              "compile_s_per_bucket": {a: engines[a].executor.cpu_compile_seconds for a in arms if a != "eager"},
              "greedy_rows_identical_to_eager": {a: f"{sum(x == y for x, y in zip(toks['eager'], toks[a]))}/8"
                                                 for a in arms if a != "eager"},
              "decode_tok_s_median": medians(runs),
              "ratio_median_of_rounds": ratio, "runs": runs,
              "dynamo_unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
