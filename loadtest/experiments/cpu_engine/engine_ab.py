"""Interleaved in-process engine A/Bs on the CPU (loadtest/experiments/cpu_engine/cpu_packing.py, cpu_attention_ab.py, cpu_compile_ab.py, cpu_step_overhead_ab.py).

Every arm runs the same decode workload in turn, round after round, so a machine whose speed drifts (other jobs
on the cores) slows every arm alike; a ratio is taken per round, then the median.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams

Runs = dict[str, dict[int, list[float]]]  # arm -> batch -> output tok/s per round


def smollm2_ab_setup(default_batches: str) -> tuple[argparse.Namespace, list[int], LLMEngine]:
    """The arguments every SmolLM2 bf16 A/B takes (--json, --rounds, --batches, --threads), the torch threads set,
    and the eager engine they share (max_num_seqs = the largest batch)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batches", default=default_batches)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.models.smollm2 import smollm2_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=str(smollm2_checkpoint()), dtype="bfloat16", device="cpu", cpu_compile="off",
                                    max_num_seqs=max(batches)))
    return args, batches, engine


def decode_prompts(batch: int) -> list[list[int]]:
    """batch fixed 50-token prompts (distinct, so no prefix-cache hits between rows)."""
    return [[100 + (i * 7 + j) % 4000 for j in range(50)] for i in range(batch)]


def decode_tok_s(engine: LLMEngine, batch: int, out_len: int = 64, warm: bool = False) -> float:
    """Output tokens per second of batch greedy requests of out_len tokens (ignore_eos); warm: one short request
    first, outside the timing."""
    if warm:
        engine.generate(decode_prompts(1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(decode_prompts(batch), params, use_tqdm=False)
    return batch * out_len / (time.perf_counter() - t)


def interleaved(arms: Iterable[str], batches: list[int], rounds: int, measure: Callable[[str, int], float]) -> Runs:
    """measure(arm, batch) for every round, batch and arm, arms innermost."""
    names = list(arms)
    runs: Runs = {n: {b: [] for b in batches} for n in names}
    for _ in range(rounds):
        for b in batches:
            for name in names:
                runs[name][b].append(round(measure(name, b), 2))
    return runs


def median_ratio(runs: Runs, a: str, b: str) -> dict[int, float]:
    """Per batch, the median over rounds of arm a's tok/s over arm b's."""
    return {batch: round(statistics.median(x / y for x, y in zip(runs[a][batch], runs[b][batch])), 3)
            for batch in runs[a]}


def medians(runs: Runs) -> dict[str, dict[int, float]]:
    return {n: {b: statistics.median(v) for b, v in per.items()} for n, per in runs.items()}
