"""CPU serving of SmolLM2-135M-Instruct in float32, bfloat16 and weight-only int8 / int4: quality and speed.

`python -m loadtest.experiments.cpu_quant.cpu_quant [--json PATH] [--threads N]`. For each variant, in one process:
- perplexity of a fixed public-domain text (loadtest/data/alice_ch1.txt, Carroll, 1865) from prompt logprobs;
- greedy agreement with float32 kvmesh (which equals transformers' float32: tests/test_smollm2.py) on 32 chat
  questions, 32 tokens each: identical sequences and mean tokens before the first difference;
- decode throughput at batch 1, 8 and 32 (prompts of ~50 tokens, 64 output tokens, ignore_eos), engine
  in-process, so the figures are the engine's alone.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from loadtest.report_json import emit_report

VARIANTS = [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4"), ("float32", "int4")]
from loadtest.chat_prompts import PERPLEXITY_TEXT as TEXT  # noqa: E402


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from loadtest.chat_prompts import KINDS, TOPICS
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import encode_chat, load_tokenizer
    from shared.sampling_params import SamplingParams

    model = str(smollm2_checkpoint())
    tok = load_tokenizer(model)
    text_ids = tok(TEXT.read_text())["input_ids"]
    questions = [k.format(t) for t in TOPICS for k in KINDS][:32]
    chats = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    story = [encode_chat(tok, [{"role": "user", "content": f"Tell me a long story about the town of {t}."}])
             for t in TOPICS * 2]
    results, reference = {}, None
    for dtype, quant in VARIANTS:
        name = dtype + (f"+{quant}" if quant else "")
        engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device="cpu", quantization=quant,
                                        num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048))
        out = engine.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        lps = [p.logprob for p in out.prompt_logprobs if p is not None]
        ppl = math.exp(-sum(lps) / len(lps))
        greedy = [o.output_token_ids for o in engine.generate(
            chats, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)]
        if reference is None:
            reference = greedy
        speed = {}
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = story[:batch]
            params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            speed[str(batch)] = round(batch * 64 / (time.perf_counter() - t0), 2)
        results[name] = {
            "perplexity": round(ppl, 4), "text_tokens": len(text_ids),
            "identical_to_float32": sum(a == b for a, b in zip(greedy, reference)),
            "mean_tokens_before_difference": sum(_first_difference(a, b) for a, b in zip(greedy, reference)) / len(chats),
            "tok_per_s_by_batch": speed,
        }
        print(name, json.dumps(results[name]), flush=True)
        del engine
    base = results["float32"]
    for r in results.values():
        r["perplexity_vs_float32"] = round(r["perplexity"] / base["perplexity"], 4)
        r["speed_vs_float32"] = {b: round(v / base["tok_per_s_by_batch"][b], 2) for b, v in r["tok_per_s_by_batch"].items()}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    report = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "cpu": cpu, "threads": args.threads,
              "cpu_bf16": "avx512_bf16" in flags or "amx_bf16" in flags, "torch": torch.__version__,
              "loadavg_1m": os.getloadavg()[0], "greedy_prompts": len(chats), "greedy_tokens": 32,
              "variants": results}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
