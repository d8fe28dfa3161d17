"""Greedy agreement of an FP8 (e4m3) KV cache with a bf16 one, and the bytes per block of each.

`python -m loadtest.fp8_agreement [--json PATH]`: the four test architectures (tiny, random weights,
bf16 on CPU), 12 prompts x 32 greedy tokens each. Random tiny models have flat next-token distributions,
so one rounding difference flips a token far more often than with a trained model: read this as a
lower bound, and measure real checkpoints on a GPU.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from shared.engine.kv_cache import bytes_per_block
from tests.checkpoints import ARCHS, build_checkpoint
from tests.engine_helpers import greedy, make_engine, random_prompts

MAX_TOKENS = 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = random_prompts([5, 17, 33, 40, 64, 80, 100, 120, 150, 200, 30, 90], seed=3)
    report = {}
    with tempfile.TemporaryDirectory() as d:
        for arch in ARCHS:
            ckpt = build_checkpoint(arch, Path(d) / arch)
            base = make_engine(ckpt, dtype="bfloat16").generate(prompts, greedy(MAX_TOKENS, None), use_tqdm=False)
            engine = make_engine(ckpt, dtype="bfloat16", kv_cache_dtype="fp8")
            fp8 = engine.generate(prompts, greedy(MAX_TOKENS, None), use_tqdm=False)
            before = [next((i for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)) if x != y),
                           MAX_TOKENS) for a, b in zip(base, fp8)]
            mc = engine.model_config
            report[arch] = {
                "identical_sequences": sum(a.output_token_ids == b.output_token_ids for a, b in zip(base, fp8)),
                "first_token_equal": sum(a.output_token_ids[0] == b.output_token_ids[0] for a, b in zip(base, fp8)),
                "mean_tokens_before_divergence": sum(before) / len(before), "requests": len(prompts),
                "tokens_per_request": MAX_TOKENS,
                "block_bytes_bf16": bytes_per_block(mc, 16, torch.bfloat16),
                "block_bytes_fp8": bytes_per_block(mc, 16, torch.float8_e4m3fn)}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
