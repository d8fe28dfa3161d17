"""Mask time per decode step of the two maintained grammar engines (xgrammar, llguidance) on one tokenizer.

`python -m loadtest.experiments.structured_outputs.grammar_masks [--json PATH]`: each engine compiles the same JSON schema, then follows
the same token sequence (a valid answer sampled once under xgrammar's mask), filling a bitmask before
every token; reported: compile time and mean/p99 mask time per step. The tokenizer is the demo model's
byte-level BPE (no real tokenizer can be downloaded here); padded to a 151,936-row vocabulary, as Qwen3.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from loadtest.report_json import emit_report

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.models.demo_tokenizer import cached_byte_bpe, write_tokenizer_files

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(cached_byte_bpe(2048), d)
        tok = AutoTokenizer.from_pretrained(d)
    vocab, eos = args.vocab_size, tok.eos_token_id
    spec = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    xinfo = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False).compile_json_schema(spec, any_whitespace=False)
    x_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
    llguidance.LLMatcher(ltok, grammar)
    l_compile = time.perf_counter() - t0

    def xgrammar_matcher():
        m, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        return mask, (lambda: m.fill_next_token_bitmask(mask, 0)), m.accept_token, m.is_terminated

    def llguidance_matcher():
        m, mask = llguidance.LLMatcher(ltok, grammar), llguidance.torch.allocate_token_bitmask(1, vocab)
        return (mask, (lambda: llguidance.torch.fill_next_token_bitmask(m, mask, 0)), m.consume_token,
                lambda: m.is_stopped())

    results, answers = {}, {}
    for name, make in (("xgrammar", xgrammar_matcher), ("llguidance", llguidance_matcher)):
        # Each engine follows its own valid answers: random logits (same seeds) under its own mask.
        per_step, lengths = [], []
        for run in range(args.runs):
            g = torch.Generator().manual_seed(run)
            mask, fill, accept, done = make()
            n = 0
            while not done() and n < 400:
                s = time.perf_counter()
                fill()
                per_step.append(time.perf_counter() - s)
                logits = torch.randn(1, vocab, generator=g)
                xgr.apply_token_bitmask_inplace(logits, mask)
                accept(int(logits.argmax()))
                n += 1
            lengths.append(n)
        per_step.sort()
        results[name] = {"mean_us": statistics.mean(per_step) * 1e6,
                         "p99_us": per_step[int(0.99 * (len(per_step) - 1))] * 1e6,
                         "steps": len(per_step), "mean_answer_tokens": statistics.mean(lengths)}
    results["xgrammar"]["compile_ms"] = x_compile * 1e3
    results["llguidance"]["compile_ms"] = l_compile * 1e3
    report = {"vocab_size": vocab, "tokenizer": "demo byte-level BPE (2,048 learned tokens, padded)",
              "schema": SCHEMA, "engines": results}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
