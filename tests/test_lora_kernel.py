"""The batched multi-LoRA kernels (kernels/lora_shrink_expand.py): the Triton shrink/expand (run by Triton's
interpreter here) equals its torch twin and a plain per-row reference on batches mixing adapters and base rows,
into a column slice of a fused output; and every variant the engine launches compiles for sm_80 and sm_90
ahead of time without spills (kernels/aot.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.aot import LaunchRecorder, compile_variants
from kernels.lora_shrink_expand import lora_shrink_expand, lora_shrink_expand_ref, lora_shrink_expand_triton
from kernels.triton_support import triton

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")


def _case(rows: int, fin: int, fout: int, slots: int, rank: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, fin, generator=g)
    a = torch.randn(slots, rank, fin, generator=g) * 0.1
    b = torch.randn(slots, fout, rank, generator=g) * 0.1
    idx = torch.randint(-1, slots, (rows,), generator=g, dtype=torch.int32)
    fused = torch.randn(rows, fout + 24, generator=g)  # the adapted projection is a column slice of a wider output
    return x, a, b, idx, fused


def _per_row(y: torch.Tensor, x, a, b, idx) -> torch.Tensor:  # noqa: ANN001
    out = y.clone()
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            out[i] += (x[i] @ a[s].t()) @ b[s].t()
    return out


@pytest.mark.parametrize("rows,fin,fout,rank", [(7, 64, 96, 8), (1, 160, 64, 16), (13, 40, 200, 4)])
def test_twin_equals_a_per_row_reference(rows, fin, fout, rank) -> None:  # noqa: ANN001
    x, a, b, idx, fused = _case(rows, fin, fout, 3, rank)
    y = fused[:, 8 : 8 + fout]
    want = _per_row(y, x, a, b, idx)
    before = fused.clone()
    lora_shrink_expand_ref(y, x, a, b, idx)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[:, :8], before[:, :8])  # columns outside the slice untouched
    torch.testing.assert_close(fused[:, 8 + fout :], before[:, 8 + fout :])
    same = torch.full((rows,), 1, dtype=torch.int32)  # one adapter for every row: the no-gather path
    y2 = fused[:, 8 : 8 + fout].clone()
    lora_shrink_expand(y2, x, a, b, same)
    torch.testing.assert_close(y2, _per_row(fused[:, 8 : 8 + fout], x, a, b, same), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("rows,fin,fout,rank", [(5, 64, 96, 8), (3, 40, 200, 16)])
def test_triton_equals_twin(rows, fin, fout, rank) -> None:  # noqa: ANN001
    x, a, b, idx, fused = _case(rows, fin, fout, 3, rank, seed=1)
    idx[0] = -1  # a base row
    y_ref = fused[:, 8 : 8 + fout].clone()
    lora_shrink_expand_ref(y_ref, x, a, b, idx)
    y = fused.clone()
    lora_shrink_expand_triton(y[:, 8 : 8 + fout], x, a, b, idx, block_k=32, block_n=64)
    torch.testing.assert_close(y[:, 8 : 8 + fout], y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[:, 0], fused[:, 0])


@needs_triton
@pytest.mark.slow  # the default run compiles them with every other kernel (tests/test_kernel_aot_compile.py)
def test_every_lora_variant_compiles_for_sm80_and_sm90() -> None:
    # SmolLM2-135M's projections (576 hidden, 192 KV, 1536 intermediate) in bfloat16 (what a GPU serves), rank 16.
    with LaunchRecorder() as rec:
        for dtype in (torch.bfloat16,):
            for fin, fout in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
                x = torch.zeros(3, fin, dtype=dtype)
                y = torch.zeros(3, fout + 64, dtype=dtype)[:, 64:]
                a = torch.zeros(2, 16, fin, dtype=dtype)
                b = torch.zeros(2, fout, 16, dtype=dtype)
                lora_shrink_expand(y, x, a, b, torch.zeros(3, dtype=torch.int32))
    assert rec.kernels() == {"_lora_shrink_kernel", "_lora_expand_kernel"}
    reports = compile_variants(list(rec.variants), [80, 90])
    failed = [f"{r.variant.label()} sm_{r.arch}: {r.error}" for r in reports if not r.ok]
    assert not failed, "\n".join(failed)
    assert not [r for r in reports if r.local_bytes], "spills"
    assert all(r.shared_ok for r in reports)
