"""Greedy agreement of an FP8 (e4m3) KV cache with a bf16 one, and the bytes per block of each.

`python -m loadtest.experiments.cpu_quant.fp8_agreement --smollm2 [--json PATH]`: SmolLM2-135M-Instruct (trained weights, the
demo model), 64 prompts (32 chat questions, 32 raw text openings) x 32 greedy tokens, eos ignored.

`python -m loadtest.experiments.cpu_quant.fp8_agreement [--json PATH]`: the four test architectures (tiny, random weights,
bf16 on CPU), 12 prompts x 32 greedy tokens each. Random tiny models have flat next-token distributions,
so one rounding difference flips a token far more often than with a trained model: read this as a
lower bound, and measure real checkpoints on a GPU.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from loadtest.report_json import emit_report
from shared.engine.kv_cache import bytes_per_block
from tests.checkpoints import ARCHS, build_checkpoint
from tests.engine_helpers import greedy, make_engine, random_prompts

MAX_TOKENS = 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--smollm2", action="store_true", help="measure SmolLM2-135M-Instruct instead of the tiny test models")
    args = ap.parse_args()
    if args.smollm2:
        report = smollm2_report()
        emit_report(report, args.json)
        return
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
    emit_report(report, args.json)


TOPICS = ["the moon", "photosynthesis", "the French revolution", "Python lists", "volcanoes", "the heart",
          "rainbows", "bees", "gravity", "the internet", "chess", "coffee", "glaciers", "the Roman empire",
          "electricity", "sleep"]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), MAX_TOKENS)


def smollm2_report() -> dict:
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.demo_corpus import TEXT
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import encode_chat, load_tokenizer
    from shared.sampling_params import SamplingParams

    model = str(smollm2_checkpoint())
    tok = load_tokenizer(model)
    chats = [f"{kind} {t}." for t in TOPICS for kind in ("Explain", "Write two sentences about")]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in chats]
    words = TEXT.split()
    prompts += [tok.encode(" ".join(words[i * 37: i * 37 + 8 + i % 40])) for i in range(32)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    runs = {}
    for key, dtype, kv in (("auto", "bfloat16", "auto"), ("fp8", "bfloat16", "fp8"), ("float32", "float32", "auto")):
        engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=512,
                                        max_num_batched_tokens=1024, max_num_seqs=64))
        runs[key] = [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    before = [_first_diff(a, b) for a, b in zip(runs["auto"], runs["fp8"])]
    ref_before = [_first_diff(a, b) for a, b in zip(runs["float32"], runs["auto"])]
    # For scale: how far bf16 (weights and KV) itself stays with float32 on the same prompts.
    reference = {"bf16_vs_float32_identical_sequences": sum(a == b for a, b in zip(runs["float32"], runs["auto"])),
                 "bf16_vs_float32_mean_tokens_before_divergence": sum(ref_before) / len(ref_before)}
    return {**reference, "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, served bf16 on CPU)", "requests": len(prompts),
            "tokens_per_request": MAX_TOKENS, "ignore_eos": True,
            "identical_sequences": sum(a == b for a, b in zip(runs["auto"], runs["fp8"])),
            "first_token_equal": sum(a[0] == b[0] for a, b in zip(runs["auto"], runs["fp8"])),
            "mean_tokens_before_divergence": sum(before) / len(before)}


if __name__ == "__main__":
    main()
