"""bf16 decode on CPU with and without oneDNN pre-packed weights (shared/models/packed_linear.py), in one process.

`python -m loadtest.experiments.cpu_engine.cpu_packing [--json PATH] [--rounds 2] [--batches 1,8,32]`: SmolLM2-135M-Instruct in
bfloat16, prompts of ~50 tokens, 64 output tokens each (ignore_eos), engine in process; the two engines are
built once and measured in turns (A, B, A, B, ...) so drift on a shared machine hits both. Prints decode tok/s
per batch size and the packed/plain ratio.
"""
from __future__ import annotations

import argparse
import os

import torch

from loadtest.experiments.cpu_engine.engine_ab import decode_tok_s, interleaved
from loadtest.report_json import emit_report
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    from shared.models.smollm2 import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    engines = {name: LLMEngine(EngineConfig(model=model, dtype="bfloat16", cpu_weight_packing=packed))
               for name, packed in (("packed", True), ("plain", False))}
    batches = [int(b) for b in args.batches.split(",")]
    runs = interleaved(engines, batches, args.rounds, lambda name, b: decode_tok_s(engines[name], b, warm=True))
    best = {n: {b: round(max(v), 2) for b, v in per.items()} for n, per in runs.items()}
    report = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "threads": torch.get_num_threads(),
              "loadavg_1m_after": os.getloadavg()[0], "decode_tok_s_best": best,
              "ratio_packed_vs_plain": {b: round(best["packed"][b] / best["plain"][b], 3) for b in batches},
              "runs": runs}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
