"""`kvmesh bench decode`: what one decode step costs, and where the time goes.

For each batch size: that many requests are prefilled to the context length, then pure-decode steps are
timed through LLMEngine.step() (host work, launches, the kernels and the sampler's copy back: what a
serving step costs). On CUDA a torch profiler pass over a few steps gives the GPU-busy share (summed
kernel time / step wall time) and the kernel launches per step. Last, the decode attention kernel alone
on synthetic caches: bytes of K and V read per second, as a fraction of what a device-to-device copy
reaches in the same run (the practical ceiling of a memory-bound kernel).
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

import torch

from loadtest.shapes import SHAPES, build_shape_checkpoint, checkpoint_dtype, has_weights
from loadtest.workload import ModelShape, build_bench_model, machine_info, random_tokens, read_shape, warn_if_busy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint dir (default: build --shape in a temp dir)")
    p.add_argument("--shape", choices=["bench", *SHAPES], default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma list")
    p.add_argument("--context-len", type=int, default=512, help="tokens in each request's context while timed")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--profile-steps", type=int, default=5, help="steps under the torch profiler (CUDA only)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--quantization", default="auto", choices=["auto", "fp8", "awq", "gptq"],
                   help="the weights: fp8 (W8A8, quantized at load), awq / gptq (4-bit, group 128; a built --shape "
                        "checkpoint gets the quantization_config and random weights rounded to 4 bits); auto: the "
                        "checkpoint's own")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attn-batch", type=int, default=64, help="decode attention kernel test: sequences")
    p.add_argument("--attn-context", type=int, default=2048, help="decode attention kernel test: context length")
    p.add_argument("--threads", type=int, help="torch intra-op threads")


@contextlib.contextmanager
def _model(args: argparse.Namespace) -> Iterator[str]:
    if args.model:
        yield args.model
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-decode-bench-") as tmp:
        print(f"building a {args.shape}-shaped checkpoint with random weights in {tmp}", file=sys.stderr)
        out = build_bench_model(tmp, ModelShape()) if args.shape == "bench" else build_shape_checkpoint(
            tmp, SHAPES[args.shape])
        if args.quantization in ("awq", "gptq"):
            from loadtest.offline import mark_4bit

            mark_4bit(out, args.quantization)
        yield out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _fill(engine, batch: int, context_len: int, steps: int, vocab: int, seed: int) -> list[str]:
    """Prefill `batch` requests so that each is about to decode at context_len; return their ids."""
    import random

    from shared.sampling_params import SamplingParams

    rng = random.Random(seed)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    # The first requests decode while the last ones still prefill: each may run to max_model_len (which leaves
    # room for the prefill steps, see fill_steps), never to a max_tokens below it.
    params = SamplingParams(max_tokens=engine.max_model_len - context_len + 1, temperature=0.0, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, random_tokens(rng, context_len - 1, vocab), params)
    # Until every request has its first token, steps contain prefill chunks; after that only decodes.
    while any(r in engine.scheduler.requests and engine.scheduler.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()
    gone = [r for r in ids if r not in engine.scheduler.requests]
    if gone:
        raise RuntimeError(f"{len(gone)} of {batch} requests finished before the timed steps (max_model_len "
                           f"{engine.max_model_len} too short for context {context_len} and the prefill steps)")
    return ids


def fill_steps(batch: int, context_len: int, max_num_batched_tokens: int) -> int:
    """Steps until the last of `batch` prompts of context_len tokens has its first token (decodes of the earlier
    ones share each step's token budget), with a margin."""
    return 2 * -(-batch * context_len // max_num_batched_tokens) + 4


def _profile(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    _sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync("cuda")
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels) if kernels and hasattr(kernels[0], "device_time") else sum(
        e.cuda_time for e in kernels)
    return {"gpu_busy_share": busy_us / 1e6 / wall, "device_events_per_step": len(kernels) / steps,
            "profiled_step_ms": wall / steps * 1e3}


def decode_steps(engine, args: argparse.Namespace, vocab: int) -> list[dict]:
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",") if b.strip()]:
        if batch > engine.config.max_num_seqs:
            rows.append({"batch": batch, "skipped": f"max_num_seqs is {engine.config.max_num_seqs}"})
            continue
        extra = args.profile_steps if args.device.startswith("cuda") else 0
        ids = _fill(engine, batch, args.context_len, args.steps + extra + 1, vocab, seed=batch)
        engine.step()  # one untimed pure-decode step (first replay of this bucket's graph)
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        _sync(args.device)
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        row = {"batch": batch, "context_len": args.context_len, "ms_per_step": ms, "tok_s": batch / ms * 1e3}
        row |= _profile(engine, extra) if extra else {"gpu_busy_share": None, "device_events_per_step": None}
        for rid in ids:
            engine.abort(rid)
        rows.append(row)
        busy = "n/a" if row["gpu_busy_share"] is None else f"{row['gpu_busy_share']:.0%}"
        print(f"batch {batch:4d}: {ms:8.2f} ms/step  {row['tok_s']:9.1f} tok/s  GPU busy {busy}", flush=True)
    return rows


def attention_bandwidth(cfg, dtype: torch.dtype, kv_dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """The decode attention kernel alone on a synthetic paged cache, against a device copy's bandwidth."""
    from kernels.decode_attention import decode_attention

    dev, bs = args.device, 16
    batch, ctx = args.attn_batch, args.attn_context
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, device=dev).to(kv_dtype)
    v = torch.randn(shape, device=dev).to(kv_dtype)
    tables = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=dev).to(dtype)
    run = lambda: decode_attention(q, k, v, tables, lens, cfg.head_dim**-0.5)  # noqa: E731
    attn_s = _time(run, dev)
    kv_bytes = 2 * batch * ctx * cfg.num_kv_heads * cfg.head_dim * k.element_size()
    src = torch.empty(max(kv_bytes, 256 << 20) // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), dev)
    attn_bw = kv_bytes / attn_s
    copy_bw = 2 * src.numel() * 4 / copy_s  # read + write
    return {"batch": batch, "context_len": ctx, "kv_bytes": kv_bytes, "attention_ms": attn_s * 1e3,
            "attention_bytes_per_s": attn_bw, "copy_bytes_per_s": copy_bw, "fraction_of_copy": attn_bw / copy_bw}


def _time(fn, device: str, reps: int = 10) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def run(args: argparse.Namespace) -> int:
    from shared.config import EngineConfig
    from loadtest.offline import quantized_dummy
    from shared.engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info(args.device)
    warn_if_busy()
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    with _model(args) as model:
        shape = read_shape(model)
        dtype = args.dtype if args.dtype != "auto" else (
            checkpoint_dtype(model) if args.device.startswith("cuda") else "float32")
        batched_tokens = max(2048, args.context_len)
        engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, device=args.device,
            load_format="auto" if has_weights(model) and not quantized_dummy(model) else "dummy",
            quantization=args.quantization,
            max_num_seqs=max(batches), max_num_batched_tokens=batched_tokens,
            max_model_len=args.context_len + args.steps + args.profile_steps + 8
            + fill_steps(max(batches), args.context_len, batched_tokens),
            kv_cache_bytes=None if args.device.startswith("cuda") else 1 << 30,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager))
        steps = decode_steps(engine, args, shape["vocab_size"])
        attn = attention_bandwidth(engine.model_config, engine.dtype, engine.kv_dtype, args)
        print(f"decode attention: {attn['attention_bytes_per_s'] / 1e9:.1f} GB/s of K/V, "
              f"{attn['fraction_of_copy']:.0%} of a device copy ({attn['copy_bytes_per_s'] / 1e9:.1f} GB/s)")
        report = {"model": shape | {"shape": args.shape if not args.model else None, "dtype": str(engine.dtype),
                                    "quantization": engine.config.quantization,
                                    "kv_cache_dtype": str(engine.kv_dtype)},
                  "cuda_graphs": engine.runner.graphs is not None, "steps": steps, "decode_attention": attn,
                  "machine": machine}
        # A caller that runs several benches in one process (the GPU check) needs the KV pool back before the
        # next engine measures the device's free memory.
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
