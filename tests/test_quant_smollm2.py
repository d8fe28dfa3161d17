"""The real SmolLM2-135M quantized to FP8 (W8A8, at load) and to 4 bits (an AWQ checkpoint written here, group 32)
and served through the kernels' torch twins in float32: perplexity of a fixed text within 1% (FP8) and 3% (4-bit)
of the unquantized model, and greedy answers to chat questions mostly the unquantized model's own.

Slow: the 4-bit twin dequantizes every weight at every step (the CPU path is the reference, not a fast path)."""
from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.models.tokenizer import encode_chat, load_tokenizer
from shared.sampling_params import SamplingParams
from tests import quant_checkpoints as qc

pytestmark = pytest.mark.slow
TEXT = (Path(__file__).resolve().parents[1] / "loadtest" / "data" / "alice_ch1.txt").read_text()
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Write a haiku about the sea."]


def _engine(path: Path, quantization: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256,
                                  quantization=quantization))


def _perplexity(engine: LLMEngine, ids: list[int]) -> float:
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [p.logprob for p in out.prompt_logprobs if p is not None]
    return math.exp(-sum(lps) / len(lps))


def test_smollm2_quantized_keeps_its_perplexity_and_answers(smollm2_dir, tmp_path) -> None:
    tok = load_tokenizer(smollm2_dir)
    ids = tok(TEXT)["input_ids"][:256]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    t0 = time.perf_counter()
    awq = qc.write_quantized(Path(smollm2_dir), tmp_path / "awq", "awq", qc.awq_config(32), group=32)
    print(f"AWQ checkpoint written in {time.perf_counter() - t0:.1f} s")
    engines = {"unquantized": _engine(smollm2_dir), "fp8": _engine(smollm2_dir, "fp8"), "awq": _engine(awq)}
    ppl, answers = {}, {}
    for name, engine in engines.items():
        ppl[name] = _perplexity(engine, ids)
        answers[name] = [o.output_token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)]
    print({k: round(v, 4) for k, v in ppl.items()})
    assert abs(ppl["fp8"] / ppl["unquantized"] - 1) < 0.01, ppl
    assert abs(ppl["awq"] / ppl["unquantized"] - 1) < 0.03, ppl
    for name in ("fp8", "awq"):
        same = sum(a == b for a, b in zip(answers[name], answers["unquantized"]))
        print(name, f"{same}/{len(QUESTIONS)} greedy answers identical to the unquantized model's")
        # a near-tie may resolve the other way after quantization: most, not all, must agree
        assert same >= len(QUESTIONS) // 2, (name, answers[name], answers["unquantized"])
