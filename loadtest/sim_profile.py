"""`kvmesh bench sim-profile`: fit the simulated engine's cost model (shared/engine/sim_profile.py) to the real
engine's steps on this machine, and write it as a profile `--engine sim --sim-profile` reads.

It runs the real engine on a checkpoint (prefill-only requests of several prompt lengths, then decode
batches of several sizes and contexts), times every step with the shape the cost model sees, and fits
the five coefficients by non-negative least squares. The profile records the samples' relative error.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sim_engine import SimEngine
from shared.engine.sim_profile import FORMAT, Profile, StepShape
from shared.sampling_params import SamplingParams

TERMS = ("base_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s", "decode_context_token_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory the real engine runs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-lens", default="64,256,1024", help="prompt lengths timed alone")
    parser.add_argument("--batches", default="1,4,16", help="decode batch sizes timed")
    parser.add_argument("--contexts", default="128,512", help="decode context lengths timed")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per (batch, context)")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="KV capacity to record (default: the engine's pool on this machine)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--json", required=True, metavar="PATH", help="where the profile goes")


def _vector(s: StepShape) -> list[float]:
    return [1.0, s.prefill_tokens, s.prefill_attention, s.decode_seqs, s.decode_context_tokens]


def measure(engine: LLMEngine, prefill_lens: list[int], batches: list[int], contexts: list[int],
            decode_steps: int) -> list[tuple[StepShape, float]]:
    samples: list[tuple[StepShape, float]] = []
    real_run = engine.executor.run  # a step's compute, after its schedule

    def timed(eng, plan):  # noqa: ANN001, ANN202
        shape = SimEngine.shape(plan)
        t0 = time.perf_counter()
        out = real_run(eng, plan)
        if not plan.is_empty:
            samples.append((shape, time.perf_counter() - t0))
        return out

    engine.executor.run = timed  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, not kept
    samples.clear()
    for n in prefill_lens:
        for _ in range(2):
            prompt = rng.integers(4, vocab, n).tolist()  # fresh tokens: no prefix-cache hit
            engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    prefill_only = list(samples)
    samples.clear()
    for b in batches:
        for c in contexts:
            prompts = [rng.integers(4, vocab, c).tolist() for _ in range(b)]
            engine.generate(prompts, SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True), use_tqdm=False)
    decode = [(s, t) for s, t in samples if s.prefill_tokens == 0]
    return prefill_only + decode


def fit(samples: list[tuple[StepShape, float]]) -> tuple[dict[str, float], float]:
    """Non-negative least squares on relative error (each row scaled by 1/t, so short steps count as much as
    long ones): the coefficients and the samples' median relative error."""
    a = np.array([_vector(s) for s, _ in samples], dtype=float)
    t = np.array([t for _, t in samples], dtype=float)
    w = a / t[:, None]
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:  # drop the negative terms one at a time (a small active-set NNLS)
        sol, *_ = np.linalg.lstsq(w[:, active], np.ones(len(t)), rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    rel = np.abs(a @ coef - t) / t
    return dict(zip(TERMS, (float(c) for c in coef))), float(np.median(rel))


def run(args: argparse.Namespace) -> int:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    max_num_batched_tokens=max(ints(args.prefill_lens) + [2048])))
    samples = measure(engine, ints(args.prefill_lens), ints(args.batches), ints(args.contexts), args.decode_steps)
    coef, median_rel = fit(samples)
    name = args.name or f"{platform.node() or 'this-machine'}-{Path(args.model).name}-{args.device}"
    profile = Profile(
        format=FORMAT, name=name,
        source=f"fitted by `kvmesh bench sim-profile` on {len(samples)} timed steps of the real engine "
               f"({time.strftime('%Y-%m-%d')}); median relative error {median_rel:.1%}",
        hardware=f"{args.device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        model=f"{Path(args.model).name} ({engine.dtype})",
        kv_tokens=args.kv_tokens or engine.num_blocks * engine.config.block_size,
        max_num_seqs=engine.config.max_num_seqs, step=coef,
        fit={"median_relative_error": median_rel, "samples": len(samples),
             "loadavg": list(os.getloadavg()),
             "points": [{**vars(s), "seconds": t} for s, t in samples]})
    Path(args.json).write_text(json.dumps(profile.model_dump(), indent=2) + "\n")
    print(json.dumps({"name": name, "step": coef, "median_relative_error": median_rel, "samples": len(samples)},
                     indent=2))
    return 0
