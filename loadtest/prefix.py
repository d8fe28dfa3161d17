"""`kvmesh bench prefix`: time to first token with a cold cache vs a prefix-cache hit.

One request with a long prompt fills the cache; then requests sharing its first `shared_len`
tokens (each with its own random tail) should only prefill the tail. TTFT is timed from
add_request to the step that returns the request's first token, one request at a time.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from loadtest.offline import model_dir
from loadtest.workload import machine_info, random_tokens, read_shape, warn_if_busy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint dir (default: build the benchmark model in a temp dir)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--shared-len", type=int, default=2000, help="prefix the warm requests share with the cold one")
    p.add_argument("--num-warm", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)


def make_engine(model: str, args: argparse.Namespace):
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype="float32", device=args.device, block_size=args.block_size,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  kv_cache_bytes=args.kv_cache_bytes, enable_prefix_caching=True))


def time_to_first_token(engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the prompt tokens the cache served."""
    from shared.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                ttft = time.perf_counter() - start
                while engine.has_unfinished_requests():  # max_tokens=1: normally already done
                    engine.step()
                return ttft, out.num_cached_tokens
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"request {request_id} finished without producing a token")


def run(args: argparse.Namespace) -> int:
    assert 0 < args.shared_len <= args.prompt_len and args.num_warm > 0
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info(args.device)  # before anything runs: its load average is other people's work
    warn_if_busy()
    with model_dir(args) as model:
        shape = read_shape(model)
        vocab = shape["vocab_size"]
        rng = random.Random(args.seed)
        base = random_tokens(rng, args.prompt_len, vocab)
        tails = [random_tokens(rng, args.prompt_len - args.shared_len, vocab) for _ in range(args.num_warm)]
        engine = make_engine(model, args)
        # Warm-up on an unrelated prompt of the same length: first-call costs and allocator growth are
        # paid here, so "cold" means only "nothing cached", and nothing of it can be a cache hit.
        time_to_first_token(engine, "warmup", random_tokens(rng, args.prompt_len, vocab))
        cold_s, cold_cached = time_to_first_token(engine, "cold", base)
        warm = [time_to_first_token(engine, f"warm{i}", base[:args.shared_len] + tail) for i, tail in enumerate(tails)]
    warm_s = statistics.mean(t for t, _ in warm)
    expected = args.shared_len // args.block_size * args.block_size  # only full blocks are shared
    warm_cached = [c for _, c in warm]
    if min(warm_cached) < expected:
        print(f"WARNING: warm requests reused {min(warm_cached)} cached tokens, expected {expected}", file=sys.stderr)
    report = {
        "ttft_cold_s": cold_s,
        "ttft_warm_s": warm_s,
        "ratio": cold_s / warm_s,
        "cold_cached_tokens": cold_cached,
        "warm_cached_tokens": warm_cached,
        "expected_cached_tokens": expected,
        "ttft_warm_all_s": [t for t, _ in warm],
        "workload": {"prompt_len": args.prompt_len, "shared_len": args.shared_len, "num_warm": args.num_warm,
                     "seed": args.seed, "block_size": args.block_size, "max_tokens": 1,
                     "max_num_batched_tokens": args.max_num_batched_tokens,
                     "timing": "add_request -> step() returning the request's first token, one request at a time"},
        "model": shape | {"dir": args.model or "(temp dir, seed 0)", "dtype": "float32"},
        "machine": machine,
    }
    print(f"TTFT cold {cold_s * 1000:.1f} ms ({cold_cached} cached tokens)")
    print(f"TTFT warm {warm_s * 1000:.1f} ms (mean of {args.num_warm}; cached tokens {warm_cached})")
    print(f"ratio     {report['ratio']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
