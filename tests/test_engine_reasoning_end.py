"""The engine's reasoning-aware structured outputs (SamplingParams.reasoning_end_ids): no token mask until the
output has written the end marker (here two tokens long), the grammar from the token after it, and the grammar's
completion ends the request; without the field the grammar holds from the first token. On a real test
checkpoint through LLMEngine; the gateway's use of it is tested in tests/test_reasoning_constraints.py."""
from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from shared.sampling_params import SamplingParams, StructuredOutput
from tests.engine_helpers import make_engine, random_prompts

DIGITS = StructuredOutput(kind="regex", spec="[0-9]{3}")


def test_the_grammar_starts_after_the_end_marker(checkpoints) -> None:  # noqa: ANN001
    ckpt = checkpoints["qwen3"]
    engine = make_engine(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    (prompt,) = random_prompts([12], seed=4)
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].output_token_ids
    # The marker: two tokens the free run writes, and not earlier in it.
    k = next(k for k in range(2, 10) if all(free[i:i + 2] != free[k:k + 2] for i in range(k)))
    end = free[k:k + 2]
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, structured=DIGITS,
                                                   reasoning_end_ids=end), use_tqdm=False)[0]
    ids = out.output_token_ids
    assert ids[:k + 2] == free[:k + 2], "no mask before the marker: the free run's tokens"
    answer = tok.decode(ids[k + 2:], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{3}", answer) and out.finish_reason == "stop"
    # Without the marker the grammar holds from the first token.
    whole = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, structured=DIGITS),
                            use_tqdm=False)[0]
    assert re.fullmatch("[0-9]{3}", tok.decode(whole.output_token_ids, skip_special_tokens=True))


def test_end_ids_are_checked_against_the_vocabulary(checkpoints) -> None:  # noqa: ANN001
    engine = make_engine(checkpoints["qwen3"])
    with pytest.raises(ValueError, match="sampling"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=DIGITS, reasoning_end_ids=[10**6]))
