"""Where one CPU decode step's time goes: torch.profiler over decode-only steps of the in-process engine.

`python -m loadtest.experiments.cpu_engine.cpu_step_profile [--batches 1,8] [--steps 20] [--json PATH] [--cpu-compile off|on]
[--cpu-kernels native|torch] [--quantization none|auto]`:
SmolLM2-135M-Instruct in bfloat16 (packed linears, the CPU default), prompts of ~50 tokens; after the prompts
are prefilled, `--steps` decode-only steps run under the profiler. Prints, per batch size, the wall time per
step and the self CPU time per step of the top operators, grouped into matmuls, attention, norms/elementwise and
the rest (the per-op dispatch cost is the gap between the step's wall time and the ops' own time).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loadtest.report_json import emit_report
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams

# Which bucket an aten/mkldnn op's self time goes to in the summary.
GROUPS = {
    "cpp_stack": ("kvmesh_cpu::",),  # the C++ decoder stack's own loops (its matmuls are counted as matmuls)
    "matmul": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int",
               "aten::bmm"),
    "attention": ("aten::_scaled_dot_product", "aten::index_select", "aten::index_copy_", "aten::masked_fill",
                  "aten::_softmax", "aten::index", "aten::index_put_"),
    "norm_elementwise": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::mul", "aten::add", "aten::silu", "aten::neg",
                         "aten::cat", "aten::copy_", "aten::to", "aten::_to_copy", "aten::pow", "aten::mean",
                         "aten::rsqrt", "aten::embedding", "aten::slice", "aten::view", "aten::select"),
}


def _group(name: str) -> str:
    for g, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return g
    return "other"


def profile_batch(engine: LLMEngine, batch: int, steps: int) -> dict:
    prompts = [[100 + (i * 7 + j) % 4000 for j in range(50)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{batch}-{i}", p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for _, s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm decode steps outside the profile
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_plain = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_prof = (time.perf_counter() - t) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    ops = [(e.key, e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in prof.key_averages()]
    ops.sort(key=lambda x: -x[1])
    groups: dict[str, float] = {}
    for name, ms, _ in ops:
        groups[_group(name)] = groups.get(_group(name), 0.0) + ms
    return {"batch": batch, "wall_ms_per_step": round(wall_plain, 2), "wall_ms_per_step_profiled": round(wall_prof, 2),
            "self_ms_per_step_by_group": {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda x: -x[1])},
            "ops_per_step": round(sum(c for _, _, c in ops), 0),
            "top_ops": [{"op": n, "self_ms_per_step": round(ms, 3), "calls_per_step": round(c, 1)} for n, ms, c in ops[:25]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-compile", default="off")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json")
    ap.add_argument("--cpu-kernels", default="native", help="native: the C++ decoder stack; torch: the Python path")
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from shared.models.smollm2 import smollm2_checkpoint

    cfg = EngineConfig(model=str(smollm2_checkpoint()), dtype="bfloat16", device="cpu",
                       quantization=args.quantization)
    if hasattr(cfg, "cpu_compile"):
        cfg.cpu_compile = args.cpu_compile
    engine = LLMEngine(cfg)
    if args.cpu_kernels == "torch":
        engine.runner.native = None
    out = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "threads": torch.get_num_threads(),
           "cpu_compile": args.cpu_compile, "cpu_kernels": args.cpu_kernels, "quantization": cfg.quantization,
           "profiles": [profile_batch(engine, int(b), args.steps) for b in args.batches.split(",")]}
    emit_report(out, args.json)


if __name__ == "__main__":
    main()
