"""CPU decode through the C++ decoder stack (shared/models/cpu_native.py) vs the Python path (torch twins), in one
engine, interleaved (issue 27: the per-op overhead of small-batch decode).

`python -m loadtest.experiments.cpu_engine.cpu_fused_decode_ab [--json PATH] [--rounds 3] [--batches 1,8,32] [--threads 1,2]
[--quantization auto]`: SmolLM2-135M-Instruct in bfloat16 served as the CLI serves it (--quantization auto: the
GGUF's Q4 blocks through int4 at <= 4 rows with a packed bf16 twin above), prompts of 50 tokens, 64 output tokens
each (ignore_eos). The arms swap the runner's C++ stack in and out per measurement, so drift on a shared machine
hits both; the ratio is the median of the per-round ratios. Also: greedy tokens of both arms (8 rows) and aten ops
dispatched from Python per decode step.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from loadtest.experiments.cpu_engine.cpu_step_overhead_ab import ops_per_decode_step
from loadtest.experiments.cpu_engine.engine_ab import decode_prompts, decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    from shared.models.smollm2 import smollm2_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=str(smollm2_checkpoint()), dtype="bfloat16", device="cpu", cpu_compile="off",
                                    quantization=args.quantization, max_num_seqs=max(batches)))
    runner = engine.runner
    native = runner.native
    assert native is not None, "the C++ stack did not load (see the log)"
    arms = {"native": native, "torch": None}

    def use(name: str) -> None:
        runner.native = arms[name]

    def measure(name: str, batch: int) -> float:
        use(name)
        return decode_tok_s(engine, batch, warm=True)

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine.generate(decode_prompts(8), greedy, use_tqdm=False)  # fills the prefix cache: both arms prefill alike
    tokens, ops = {}, {}
    for name in arms:
        use(name)
        tokens[name] = [o.output_token_ids for o in engine.generate(decode_prompts(8), greedy, use_tqdm=False)]
        ops[name] = {b: ops_per_decode_step(engine, b) for b in (1, 8)}
    report = {"issue": 27, "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16",
              "quantization": engine.config.quantization if hasattr(engine, "config") else args.quantization,
              "command": "PYTHONPATH=$PWD python -m loadtest.experiments.cpu_engine.cpu_fused_decode_ab " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if k != "json" and v is not None),
              "machine": f"{os.cpu_count()}-core AMD EPYC (AVX512-BF16), shared with other helpers' jobs: only the "
                         "same-run ratios count, not the absolute tok/s",
              "greedy_tokens_equal_8_rows_32_tokens": tokens["native"] == tokens["torch"],
              "aten_ops_from_python_per_decode_step": ops, "by_threads": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        t0 = time.time()
        runs = interleaved(arms, batches, args.rounds, measure)
        report["by_threads"][threads] = {
            "ratio_native_vs_torch_median_of_rounds": median_ratio(runs, "native", "torch"),
            "decode_tok_s_median": medians(runs), "runs": runs, "seconds": round(time.time() - t0, 1),
            "loadavg_1m_after": os.getloadavg()[0]}
        print(json.dumps(report["by_threads"][threads]["ratio_native_vs_torch_median_of_rounds"]), flush=True)
    use("native")
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
