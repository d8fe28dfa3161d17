"""The C++ decoder stack (shared/models/cpu_native.py, kernels/cpu/decoder_stack.cpp) in the real engine: greedy
tokens of the tiny transformers-built checkpoints equal with the C++ path on and off and equal to transformers
(float32), also in bf16 (on vs off), and the C++ path was really taken (its step counter moves; prompts of at most
16 tokens are prefilled through it too, longer ones through the Python path)."""
from __future__ import annotations

import pytest
import torch

from shared.models.cpu_native import MAX_CHUNK, SHORT_PROMPT, NativeDecode
from tests.checkpoints import ARCHS, build_checkpoint, hf_greedy
from tests.engine_helpers import assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: build_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=3) for arch in ARCHS}


def _reference(ckpt, prompt, max_tokens):
    return hf_greedy(ckpt.hf_model, prompt, max_tokens)


def _generate(engine, prompts):
    return engine.generate(prompts, greedy(MAX_TOKENS))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equal_with_cpp_path_on_and_off_float32(checkpoints, arch) -> None:
    ckpt = checkpoints[arch]
    # 5, MAX_CHUNK and 60 tokens (a whole short prompt, past mistral's window of 48) prefilled through the C++ stack;
    # SHORT_PROMPT + 20 through Python.
    prompts = random_prompts([5, MAX_CHUNK, 60, SHORT_PROMPT + 20], seed=7)
    engine = make_engine(ckpt, dtype="float32")
    native = engine.runner.native
    assert isinstance(native, NativeDecode), "the C++ stack must be the default CPU path"
    outs = _generate(engine, prompts[:3])
    calls = native.calls
    assert calls >= MAX_TOKENS, f"the C++ stack ran {calls} steps"
    outs += _generate(engine, prompts[3:])  # its one prefill step in Python, then MAX_TOKENS - 1 decode steps
    assert native.calls == calls + MAX_TOKENS - 1
    assert_matches_hf(ckpt, _reference, prompts, outs, MAX_TOKENS)
    calls = native.calls
    _generate(engine, random_prompts([MAX_CHUNK + 28], seed=8))  # a fresh prompt: no cached prefix
    assert native.calls == calls + MAX_TOKENS, "the short prompt's prefill step ran in C++"
    assert_all_free(engine)
    engine.runner.native = None  # the Python path, same engine and weights
    off = _generate(engine, prompts[:3]) + _generate(engine, prompts[3:])
    assert [o.output_token_ids for o in off] == [o.output_token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equal_with_cpp_path_on_and_off_bf16(checkpoints, arch) -> None:
    prompts = random_prompts([3, 9, 40, 21], seed=11)
    engine = make_engine(checkpoints[arch], dtype="bfloat16")
    native = engine.runner.native
    on = _generate(engine, prompts)
    assert native is not None and native.calls >= MAX_TOKENS
    engine.runner.native = None
    off = _generate(engine, prompts)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]


def test_python_path_when_turned_off(checkpoints, monkeypatch) -> None:
    """KVMESH_CPU_KERNELS=torch: no C++ stack; the engine serves through the Python path."""
    from kernels.cpu import extension

    monkeypatch.setattr(extension, "_state", (False, "KVMESH_CPU_KERNELS=torch"))
    engine = make_engine(checkpoints["llama"], dtype="float32")
    assert engine.runner.native is None
    outs = _generate(engine, random_prompts([7], seed=1))
    assert len(outs[0].output_token_ids) == MAX_TOKENS


def test_unknown_layers_stay_on_python(checkpoints) -> None:
    from shared.models.cpu_native import native_decode_for

    engine = make_engine(checkpoints["llama"], dtype="float32")
    model = engine.model
    model.layers[0].mlp.down_proj = torch.nn.Sequential(model.layers[0].mlp.down_proj)
    native, why = native_decode_for(model, "cpu")
    assert native is None and "Sequential" in why
    assert native_decode_for(model, "cuda")[0] is None


def _equal_until_a_near_tie(a, b) -> None:  # noqa: ANN001 - two RequestOutputs with top-5 logprobs
    i = next((i for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)) if x != y), None)
    if i is None:
        return
    pair = {a.output_token_ids[i], b.output_token_ids[i]}
    for lp in (a.logprobs[i], b.logprobs[i]):
        top = dict(lp.top)
        assert pair <= top.keys() and abs(top[min(pair)] - top[max(pair)]) <= 0.5, (i, pair, lp)


@pytest.mark.slow
def test_smollm2_greedy_with_cpp_path_on_and_off(smollm2_dir) -> None:
    """float32 (dequantized weights, plain matmuls): every row's tokens equal with the C++ path on and off. bf16 as
    served on this CPU (the GGUF's Q4 blocks through int4 at <= 4 rows, the packed bf16 twin above: --quantization
    auto): the C++ kernels round where the twins round but sum in another order, so a near-tie can flip (bf16
    logits come in steps of 1/8 here: 2-3 of these 8 rows meet a tie or a one-step gap within 24 tokens, with
    oneDNN's matmul or the kernels' own, the lone first row too; where the GGUF kernels round the activations to
    int8, a last-bit difference can move a code and the gap grew to 4 steps): every row equal until a step where
    the two paths' tokens were both in each one's top 5 within 0.5 of each other, and at least 5 of the 9 rows
    (8 batched, the first alone) equal throughout."""
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.tokenizer import encode_chat, load_tokenizer
    from shared.sampling_params import SamplingParams

    tok = load_tokenizer(smollm2_dir)
    questions = ["What is the capital of France?", "What is the largest planet in our solar system?",
                 "Write a Python function that adds two numbers.", "Tell me a long story about the town of Ely.",
                 "Name three colours.", "Why is the sky blue?", "What is 2 + 2?", "Say hello in French."]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    for dtype, quantization in (("float32", "none"), ("bfloat16", "auto")):
        engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype=dtype, quantization=quantization,
                                        num_kv_blocks=256, max_num_seqs=8))
        native = engine.runner.native
        assert native is not None
        on = engine.generate(prompts, params, use_tqdm=False)
        alone_on = engine.generate(prompts[:1], params, use_tqdm=False)[0]
        assert native.calls >= 2 * 23
        engine.runner.native = None
        off = engine.generate(prompts, params, use_tqdm=False)
        alone_off = engine.generate(prompts[:1], params, use_tqdm=False)[0]
        same = [a.output_token_ids == b.output_token_ids for a, b in zip(on + [alone_on], off + [alone_off])]
        if dtype == "float32":
            assert all(same), same
        else:
            assert sum(same) >= 5, same
            for a, b in zip(on + [alone_on], off + [alone_off]):
                _equal_until_a_near_tie(a, b)
        assert "Paris" in tok.decode(alone_on.output_token_ids)
