"""Compiled CPU decode (shared/engine/cpu_compile.py): the same greedy tokens as eager, every batch bucket compiled
at start and nothing compiled while serving, and when auto turns it on. Tiny shapes and two buckets keep the
compile to seconds."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils

from shared.engine.cpu_compile import CompiledDecode, cpu_compile_enabled
from tests.engine_helpers import assert_all_free, greedy, make_engine, random_prompts


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# one layer's graph per layer, or the whole forward in one (slow: ~110 s of compiling on the loaded 2-core CPU)
@pytest.mark.parametrize("mode", ["on", pytest.param("whole", marks=pytest.mark.slow)])
def test_compiled_decode_matches_eager_and_never_recompiles(checkpoints, mode):
    ckpt = checkpoints["qwen3"]  # q/k norm and tied embeddings: the most ops per layer
    # max_num_seqs 2: buckets [1, 2], the static batch-1 graph and the dynamic one every larger bucket uses.
    eager = make_engine(ckpt, dtype="bfloat16", cpu_compile="off", max_num_seqs=2)
    before = _unique_graphs()
    compiled = make_engine(ckpt, dtype="bfloat16", cpu_compile=mode, max_num_seqs=2)
    graphs = compiled.runner.graphs
    assert graphs is not None and isinstance(graphs.forward, CompiledDecode)
    assert [b for b, _ in compiled.executor.cpu_compile_seconds] == graphs.buckets == [1, 2]
    assert _unique_graphs() > before  # the warm-up compiled
    warmed = _unique_graphs()
    calls_at_start = graphs.forward.calls

    prompts = random_prompts([5, 23, 40, 9, 17], seed=7)  # 5 prompts, 2 at a time: batches of 1 and 2
    want = [o.output_token_ids for o in eager.generate(prompts, greedy(12, None), use_tqdm=False)]
    got = [o.output_token_ids for o in compiled.generate(prompts, greedy(12, None), use_tqdm=False)]
    assert got == want
    assert graphs.forward.calls > calls_at_start + 10  # decode steps did go through the compiled forward
    assert _unique_graphs() == warmed  # and nothing compiled while serving
    assert_all_free(compiled)


def test_auto_compiles_bf16_on_cpu_only():
    assert cpu_compile_enabled("auto", "cpu", torch.bfloat16)[0]
    on, why = cpu_compile_enabled("auto", "cpu", torch.float32)
    assert not on and "float32" in why
    assert cpu_compile_enabled("on", "cpu", torch.float32)[0]
    assert not cpu_compile_enabled("off", "cpu", torch.bfloat16)[0]
    assert not cpu_compile_enabled("auto", "cpu", torch.bfloat16, enforce_eager=True)[0]
    assert not cpu_compile_enabled("on", "cuda", torch.bfloat16)[0]
