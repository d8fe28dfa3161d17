"""The AVX512-BF16 matmul (kernels/cpu/gemv_dpbf16.cpp) against its twin, and bf16 CPU serving through it
(shared/models/dp_linear.py): the loader's choice, the GGUF hybrid on the kernels' own threads, and an engine whose
tokens and logprobs stay with oneDNN's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu.extension import native_available
from kernels.cpu.gemv_dpbf16 import linear_dpbf16, linear_dpbf16_ref, pack_dpbf16, unpack_dpbf16
from shared.models.dp_linear import ENV, DpLinear, dp_linear_choice, use_dp_linears
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import greedy, make_engine, random_prompts


def _built() -> bool:
    from kernels.cpu.gemv_dpbf16 import built

    return native_available() and built()


needs_dpbf16 = pytest.mark.skipif(not _built(), reason="the C++ kernels are off or built without AVX512-BF16")


def test_packing_round_trips_and_pads_the_last_block() -> None:
    w = torch.randn(70, 34).bfloat16()
    wp = pack_dpbf16(w)
    assert wp.shape == (3, 32 * 34)
    assert torch.equal(unpack_dpbf16(wp, 70), w)
    assert not wp.view(3, 17, 32, 2)[2, :, 6:].any()  # outputs 70..95 of the last block are zero
    with pytest.raises(AssertionError, match="even"):
        pack_dpbf16(torch.randn(4, 33).bfloat16())


@needs_dpbf16
@pytest.mark.parametrize("k,n", [(34, 70), (64, 17), (96, 40), (1040, 33)])
def test_kernel_matches_the_twin_and_a_row_does_not_depend_on_its_batch(k, n) -> None:
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    wp = pack_dpbf16(w)
    for rows in (1, 2, 3, 4, 5, 9, 13, 33):
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            got = linear_dpbf16(x, wp, n, b)
            want = linear_dpbf16_ref(x, wp, n, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            exact = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            # float32 sums in another order, each rounded to bf16 once: within a bf16 rounding of the exact sum
            # (plus a float32 summation's error, far below it)
            tol = exact.abs() * 2.0 ** -8 + 1e-3 * (x.float().abs() @ w.float().abs().t())
            assert ((got.float() - exact).abs() <= tol).all(), (rows, (got.float() - exact).abs().max())
            assert ((want.float() - exact).abs() <= tol).all()
            for r in (0, rows - 1):
                assert torch.equal(linear_dpbf16(x[r:r + 1], wp, n, b), got[r:r + 1]), (rows, r)


@needs_dpbf16
def test_wrong_inputs_are_refused() -> None:
    wp = pack_dpbf16(torch.randn(8, 64).bfloat16())
    with pytest.raises(AssertionError, match="bfloat16"):
        linear_dpbf16(torch.randn(2, 64), wp, 8)
    with pytest.raises(AssertionError, match="packed weight"):
        linear_dpbf16(torch.randn(2, 32).bfloat16(), wp, 8)
    with pytest.raises(RuntimeError, match="pack_dpbf16's layout"):
        torch.ops.kvmesh_cpu.linear_dpbf16(torch.randn(2, 64).bfloat16(), wp, 40, None)


def test_the_choice_follows_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "onednn")
    assert dp_linear_choice() == (False, f"{ENV}=onednn")
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="own or onednn"):
        dp_linear_choice()
    monkeypatch.setenv(ENV, "own")
    assert dp_linear_choice()[0] == _built()


@needs_dpbf16
def test_use_dp_linears_swaps_plain_bf16_linears_only() -> None:
    model = nn.Sequential(nn.Linear(32, 48).to(torch.bfloat16), nn.Linear(32, 32), nn.Linear(33, 8).to(torch.bfloat16))
    assert use_dp_linears(model) == 32 * 48
    assert isinstance(model[0], DpLinear)
    assert type(model[1]) is nn.Linear and type(model[2]) is nn.Linear  # float32; an odd number of inputs
    x = torch.randn(2, 5, 32).bfloat16()
    out = model[0](x)
    assert out.shape == (2, 5, 48)
    assert torch.equal(model[0].dequantized(), model[0].dequantized())
    with pytest.raises(TypeError, match="bf16 activations"):
        model[0](x.float())


@needs_dpbf16
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_engine_on_the_own_kernel_stays_with_onednn(tmp_path, arch, monkeypatch) -> None:
    """The same checkpoint in bf16 with the own matmul and with oneDNN's: every first token equal and the
    logprobs within bf16 rounding's reach; the C++ stack ran and its loops are on the kernels' threads."""
    from kernels.cpu.thread_pool import stats

    ckpt = build_checkpoint(arch, tmp_path / arch)
    monkeypatch.setenv(ENV, "onednn")
    ref = make_engine(ckpt, dtype="bfloat16")
    ref_out = ref.generate(random_prompts([5, 17, 40], seed=4), greedy(8), use_tqdm=False)
    monkeypatch.setenv(ENV, "own")
    own = make_engine(ckpt, dtype="bfloat16")
    assert isinstance(own.model.layers[0].mlp.down_proj, DpLinear) and isinstance(own.model.lm_head, DpLinear)
    assert stats()[4] == 0  # the loops left torch's OpenMP team
    calls = own.runner.native.calls
    out = own.generate(random_prompts([5, 17, 40], seed=4), greedy(8), use_tqdm=False)
    assert own.runner.native.calls > calls
    for a, b in zip(out, ref_out):
        assert a.output_token_ids[0] == b.output_token_ids[0]
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05
