"""Offline throughput with real output lengths (eos on) on SmolLM2-135M-Instruct: kvmesh's engine vs
transformers generate() in static batches, same process, same float32 weights and threads.

`python -m loadtest.experiments.cpu_quant.eos_offline [--num-prompts 32] [--max-tokens 128] [--json PATH]`. Prompts are chat
questions; each request stops at the model's eos (<|im_end|>) or max_tokens. Throughput counts each
request's tokens up to and including its eos; a static batch keeps computing finished rows until its
longest row ends, which is the cost of not batching continuously. The fixed-length workload (ignore_eos)
is `kvmesh bench offline --model DIR`.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from loadtest.chat_prompts import KINDS, TOPICS
from loadtest.report_json import emit_report


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from loadtest.hf_baselines import left_pad
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import encode_chat, load_tokenizer
    from shared.sampling_params import SamplingParams

    model = str(smollm2_checkpoint())
    tok = load_tokenizer(model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    questions = [k.format(t) for t in TOPICS for k in KINDS][: args.num_prompts]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]

    engine = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=1024, max_num_batched_tokens=2048,
                                    max_num_seqs=64))
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    ours = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
    kv_s = time.perf_counter() - t0
    ours_tokens = [o.output_token_ids for o in ours]

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        t0 = time.perf_counter()
        hf_tokens: list[list[int]] = []
        for i in range(0, len(prompts), args.batch_size):
            ids, mask = left_pad(prompts[i:i + args.batch_size])
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
            hf_tokens += [_cut(row, eos) for row in out[:, ids.shape[1]:].tolist()]
        hf_s = time.perf_counter() - t0
    n_ours, n_hf = sum(map(len, ours_tokens)), sum(map(len, hf_tokens))
    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> float32)", "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "threads": args.threads, "requests": len(prompts), "max_tokens": args.max_tokens, "eos": "on",
        "kvmesh": {"seconds": kv_s, "output_tokens": n_ours, "tok_per_s": n_ours / kv_s},
        "hf_static_batched": {"seconds": hf_s, "output_tokens": n_hf, "tok_per_s": n_hf / hf_s,
                              "batch_size": args.batch_size},
        "ratio_kvmesh_vs_hf": (n_ours / kv_s) / (n_hf / hf_s),
        "stopped_at_eos": sum(1 for o in ours if o.finish_reason == "stop"),
        "identical_outputs": sum(a == b for a, b in zip(ours_tokens, hf_tokens)),
    }
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
