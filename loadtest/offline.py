"""`kvmesh bench offline`: output tokens/s of kvmesh's engine vs three transformers baselines.

Same process, same weights, same threads, same workload. Throughput everywhere is
sum(requested output tokens) / wall-clock seconds, so a static batch's overrun is not counted.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from loadtest import hf_baselines as hf
from loadtest.shapes import SHAPES, build_shape_checkpoint, checkpoint_dtype, has_weights
from loadtest.workload import (ModelShape, RunResult, Workload, build_bench_model, machine_info, make_workload,
                               read_shape, warn_if_busy)

BASELINES = ("batched", "unbatched", "continuous")
# nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in [100, 1024], random token ids,
# ignore_eos, on Qwen3-0.6B; the H100 comparison (static batches of 128 for transformers).
PRESETS = {"nano-vllm": dict(num_prompts=256, input_len_min=100, input_len_max=1024, output_len_min=100,
                             output_len_max=1024, shape="qwen3-0.6b")}
TOK_S_DEFINITION = ("sum of requested output tokens / wall-clock seconds; tokens a static batch generates past a "
                    "request's requested length are not counted (see runs.*.generated_tokens)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint dir (default: build --shape in a temp dir)")
    p.add_argument("--shape", choices=["bench", *SHAPES], default=None,
                   help="architecture to build with random weights: bench (small Llama, float32) or a real "
                        "model's shape (its dtype); default bench, or the preset's")
    p.add_argument("--preset", choices=sorted(PRESETS), help="nano-vllm: 256 requests, lengths in [100, 1024], "
                   "Qwen3-0.6B shape (flags given explicitly still win)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 64")
    p.add_argument("--input-len-min", type=int, default=None, help="default 32")
    p.add_argument("--input-len-max", type=int, default=None, help="default 512")
    p.add_argument("--output-len-min", type=int, default=None, help="default 32")
    p.add_argument("--output-len-max", type=int, default=None, help="default 256")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on CUDA; on CPU bfloat16 where it is native, else float32 (both systems)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="kvmesh's KV cache dtype")
    p.add_argument("--quantization", default="auto", choices=["auto", "fp8", "awq", "gptq"],
                   help="kvmesh's weights: fp8 (W8A8, quantized at load), awq / gptq (4-bit, group 128; a built "
                        "--shape checkpoint gets the quantization_config and random weights rounded to 4 bits); "
                        "auto: the checkpoint's own")
    p.add_argument("--enforce-eager", action="store_true", help="kvmesh without CUDA graphs")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="kvmesh's engine split across this many ranks (on this CPU TP is for correctness, not speed)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="kvmesh's share of the GPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="kvmesh's context limit (default: the workload's longest request, not the model's)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (the model is always built from seed 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda; both systems run there")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="kvmesh max_num_seqs; also transformers CB's cap (default 64 on CPU, 256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="kvmesh per-step token budget; also transformers CB's max_batch_tokens (2048 CPU, 16384 CUDA)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV budget for kvmesh and transformers CB (default: 1 GiB on CPU; on CUDA kvmesh's memory "
                        "budget, and transformers CB gets the bytes kvmesh's pool ended up with)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='kvmesh decodes speculatively: vLLM\'s JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4} '
                        'or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}')
    p.add_argument("--skip-hf", action="store_true", help="run kvmesh only")
    p.add_argument("--skip-kvmesh", action="store_true", help="run the transformers baselines only")
    p.add_argument("--baselines", default=",".join(BASELINES), help=f"comma list out of {','.join(BASELINES)}")
    p.add_argument("--hf-batch-size", type=int, default=None, help="static batch size (default 128 on CUDA, 16 on CPU)")
    p.add_argument("--hf-unbatched-requests", type=int, default=8, help="requests timed one by one, then scaled")
    p.add_argument("--hf-attn", default="sdpa", help="attn_implementation for transformers (sdpa, eager -> paged|eager)")
    p.add_argument("--hf-page-size", type=int, default=256, help="transformers CB page size (its default)")
    p.add_argument("--hf-continuous-api", choices=("per-request", "generate_batch"), default="per-request",
                   help="per-request: the manager under generate_batch with each request's own max_new_tokens; "
                        "generate_batch: the one-call API, every request runs to the workload's longest output")
    p.add_argument("--progress", action="store_true", help="show kvmesh's progress bar (off: it is not timed free)")


DEFAULTS = dict(num_prompts=64, input_len_min=32, input_len_max=512, output_len_min=32, output_len_max=256,
                shape="bench")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what was not given: explicit flags, then the preset, then the plain defaults."""
    preset = PRESETS.get(args.preset or "", {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    cuda = args.device.startswith("cuda")
    if args.hf_batch_size is None:
        args.hf_batch_size = 128 if cuda else 16
    # nano-vllm's engine limits on a GPU (512 sequences there; 256 here, the largest graph bucket we capture
    # by default), the CPU-sized ones elsewhere.
    if args.max_num_seqs is None:
        args.max_num_seqs = 256 if cuda else 64
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 16384 if cuda else 2048
    if args.kv_cache_bytes is None and not args.device.startswith("cuda"):
        args.kv_cache_bytes = 1 << 30
    return args


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[str]:
    if args.model:
        yield args.model
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        if args.shape == "bench":
            print(f"building the benchmark model ({ModelShape()}) in {tmp}", file=sys.stderr)
            out = build_bench_model(tmp, ModelShape(), seed=0)
        else:
            print(f"building a {args.shape}-shaped checkpoint with random weights in {tmp}", file=sys.stderr)
            out = build_shape_checkpoint(tmp, SHAPES[args.shape], seed=0)
        if getattr(args, "quantization", "auto") in ("awq", "gptq"):
            mark_4bit(out, args.quantization)
        yield out


def mark_4bit(model: str, method: str) -> None:
    """A built checkpoint served as a 4-bit one: its config says so and its random weights are rounded to 4 bits
    at load (shared/models/quant_load.py), so the bench runs the 4-bit kernels at the shape."""
    path = Path(model) / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128, "zero_point": True,
                                  "sym": False, "version": "gemm", "kvmesh_dummy": True}
    path.write_text(json.dumps(raw, indent=2))


def quantized_dummy(model: str) -> bool:
    qc = json.loads((Path(model) / "config.json").read_text()).get("quantization_config") or {}
    return bool(qc.get("kvmesh_dummy"))


def resolved_dtype(model: str, args: argparse.Namespace) -> str:
    if args.dtype != "auto":
        return args.dtype
    if args.device.startswith("cuda"):
        return checkpoint_dtype(model)
    from shared.models.cpu_dtype import default_cpu_dtype

    return default_cpu_dtype()[0]  # what a kvmesh worker picks on this CPU


def engine_config(model: str, args: argparse.Namespace, wl: Workload):
    from shared.config import EngineConfig
    from shared.spec_config import SpeculativeConfig

    longest = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens))
    return EngineConfig(model=model, dtype=resolved_dtype(model, args), device=args.device,
                        load_format="auto" if has_weights(model) and not quantized_dummy(model) else "dummy",
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_bytes=args.kv_cache_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
                        enforce_eager=args.enforce_eager or args.tensor_parallel_size > 1,
                        max_model_len=args.max_model_len or longest + 1,
                        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
                        speculative_config=SpeculativeConfig.parse(args.speculative_config))


def greedy(max_tokens: int):
    from shared.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_kvmesh(model: str, wl: Workload, args: argparse.Namespace) -> RunResult:
    from shared.engine.llm_engine import LLMEngine

    from shared.engine.kv_cache import bytes_per_block

    engine = LLMEngine(engine_config(model, args, wl))
    engine.generate([[5, 6, 7, 8]], greedy(4), use_tqdm=False)  # warm-up, before the clock
    start = time.perf_counter()
    outs = engine.generate(wl.prompts, [greedy(n) for n in wl.output_lens], use_tqdm=args.progress)
    seconds = time.perf_counter() - start
    outputs = [o.output_token_ids for o in outs]
    short = [i for i, (o, n) in enumerate(zip(outputs, wl.output_lens)) if len(o) != n]
    if short:
        print(f"WARNING: kvmesh returned the wrong number of tokens for requests {short[:8]}", file=sys.stderr)
    kv_bytes = engine.num_blocks * bytes_per_block(engine.model_config, engine.config.block_size, engine.kv_dtype)
    details = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "kv_cache_bytes": kv_bytes, "num_kv_blocks": engine.num_blocks, "dtype": str(engine.dtype),
               "kv_cache_dtype": str(engine.kv_dtype), "cuda_graphs": engine.runner.graphs is not None,
               "max_model_len": engine.max_model_len, "tensor_parallel_size": engine.config.tensor_parallel_size}
    engine.shutdown()
    del engine
    gc.collect()  # free its KV pool before transformers allocates its own
    return RunResult("kvmesh", seconds, wl.total_output_tokens, sum(map(len, outputs)), outputs, details)


def run_hf(model: str, wl: Workload, args: argparse.Namespace, which: list[str], kv_cache_bytes: int | None,
           skipped: dict[str, str]) -> dict[str, RunResult]:
    """The transformers baselines; one that cannot run on this transformers is recorded in `skipped` with
    the reason, and the others still run."""
    hf_model = hf.load_hf_model(model, args.hf_attn, args.device, resolved_dtype(model, args))
    if kv_cache_bytes is None:  # CUDA without a kvmesh run to match: a third of what is free
        kv_cache_bytes = torch.cuda.mem_get_info()[0] // 3
    settings = hf.ContinuousSettings(kv_cache_bytes, args.max_num_batched_tokens, args.max_num_seqs,
                                     args.hf_page_size, args.hf_continuous_api == "per-request")
    runners = {
        "batched": lambda: hf.run_static_batched(hf_model, wl, args.hf_batch_size),
        "unbatched": lambda: hf.run_unbatched(hf_model, wl, args.hf_unbatched_requests),
        "continuous": lambda: hf.run_continuous(hf_model, wl, settings),
    }
    results = {}
    for name in which:
        print(f"transformers {name} ...", file=sys.stderr)
        try:
            results[f"hf_{name}"] = runners[name]()
        except Exception as e:  # noqa: BLE001 - an API change in transformers must not lose the other runs
            skipped[f"hf_{name}"] = f"{type(e).__name__}: {e}"
            print(f"WARNING: transformers {name} skipped: {skipped[f'hf_{name}']}", file=sys.stderr)
    del hf_model
    gc.collect()
    return results


def check_outputs(runs: dict[str, RunResult]) -> dict:
    """Greedy tokens of every run against transformers one-request-at-a-time generate(), the oracle."""
    oracle = runs.get("hf_unbatched")
    if oracle is None:
        return {"oracle": None}
    report: dict = {"oracle": "hf_unbatched", "requests_compared": len(oracle.outputs)}
    for name, run in runs.items():
        if name != oracle.name:
            pairs = list(zip(run.outputs, oracle.outputs))
            report[f"{name}_equal"] = sum(a == b for a, b in pairs)
            report[f"{name}_first_request_equal"] = bool(pairs) and pairs[0][0] == pairs[0][1]
    if report.get("kvmesh_first_request_equal") is False:
        print("WARNING: kvmesh's greedy output for request 0 differs from transformers generate()", file=sys.stderr)
    return report


def summarize(runs: dict[str, RunResult]) -> dict:
    tok_s = {f"{name}_tok_s": run.tok_s for name, run in runs.items()}
    out: dict = {k: tok_s.get(k) for k in ("kvmesh_tok_s", "hf_batched_tok_s", "hf_unbatched_tok_s", "hf_continuous_tok_s")}
    hf_runs = {n: r.tok_s for n, r in runs.items() if n.startswith("hf_")}
    best = max(hf_runs, key=hf_runs.__getitem__) if hf_runs else None
    kv = out["kvmesh_tok_s"]
    for name in ("hf_batched", "hf_unbatched", "hf_continuous"):
        base = out[f"{name}_tok_s"]
        out[f"ratio_vs_{name}"] = kv / base if kv and base else None
    out["best_hf"] = best
    out["ratio_vs_best_hf"] = kv / hf_runs[best] if kv and best else None
    return out


def print_table(runs: dict[str, RunResult], summary: dict) -> None:
    for name, run in runs.items():
        print(f"{name:<14} {run.tok_s:9.1f} tok/s  {run.seconds:8.2f} s  ({run.useful_tokens} useful tokens)")
    for key in ("ratio_vs_hf_batched", "ratio_vs_hf_unbatched", "ratio_vs_hf_continuous", "ratio_vs_best_hf"):
        if summary.get(key) is not None:
            print(f"{key:<24} {summary[key]:.2f}x")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    which = [] if args.skip_hf else [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = set(which) - set(BASELINES)
    if unknown:
        raise SystemExit(f"unknown baselines {sorted(unknown)}; choose from {', '.join(BASELINES)}")
    from shared.engine.errors import ConfigError
    from shared.spec_config import SpeculativeConfig

    try:  # before any model is built: a bad config is the first thing said
        SpeculativeConfig.parse(args.speculative_config)
    except ConfigError as e:
        raise SystemExit(f"kvmesh bench offline: {e}") from None
    resolve(args)
    machine = machine_info(args.device)  # before anything runs: its load average is other people's work
    warn_if_busy()
    with model_dir(args) as model:
        shape = read_shape(model)
        wl = make_workload(args.num_prompts, (args.input_len_min, args.input_len_max),
                           (args.output_len_min, args.output_len_max), shape["vocab_size"], args.seed)
        runs: dict[str, RunResult] = {}
        skipped: dict[str, str] = {}
        if not args.skip_kvmesh:
            print("kvmesh ...", file=sys.stderr)
            runs["kvmesh"] = run_kvmesh(model, wl, args)
        kv_bytes = args.kv_cache_bytes or (runs["kvmesh"].details["kv_cache_bytes"] if "kvmesh" in runs else None)
        runs |= run_hf(model, wl, args, which, kv_bytes, skipped) if which else {}
        same_weights = has_weights(model)
        dtype = resolved_dtype(model, args)  # reads the checkpoint: inside, before a temporary one is removed
    summary = summarize(runs)
    report = summary | {
        "tok_s_definition": TOK_S_DEFINITION,
        "workload": wl.description,
        "model": shape | {"dir": args.model or "(temp dir, seed 0)", "shape": args.shape,
                          "dtype": dtype, "same_weights_for_all": same_weights},
        "preset": args.preset,
        "machine": machine,
        "runs": {name: run.to_json() for name, run in runs.items()},
        "skipped": skipped,
        # Without shared weights (config-only shapes) the systems' greedy tokens cannot be compared.
        "correctness": check_outputs(runs) if same_weights else {"oracle": None, "reason": "different random weights"},
    }
    print_table(runs, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
