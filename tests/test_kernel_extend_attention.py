"""Triton prefill/extend attention over the paged cache against its torch twin, under Triton's interpreter on
CPU; and the twin against a naive masked softmax per sequence."""
from __future__ import annotations

import pytest
import torch

from kernels.extend_attention import extend_attention, extend_attention_ref, extend_attention_triton
from kernels.store_kv import FP8_DTYPE

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make(chunks, contexts, kv_heads, group, head_dim, block_size, dtype, fp8=False, seed=0, num_blocks=48):
    """chunks[s] new query rows of sequence s whose context after this step is contexts[s]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k, v = ((k / 2).to(FP8_DTYPE), (v / 2).to(FP8_DTYPE)) if fp8 else (k.to(dtype), v.to(dtype))
    max_blocks = max(-(-c // block_size) for c in contexts)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([perm[i * max_blocks:(i + 1) * max_blocks] for i in range(len(contexts))]).int()
    starts = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k, v, starts, torch.tensor(contexts, dtype=torch.int32), tables, max(chunks)


def check(q, k, v, starts, ctx, tables, max_q, window=None, scales=(1.0, 1.0), block_m=16):
    scale = q.shape[-1] ** -0.5
    out = extend_attention_triton(q, k, v, starts, ctx, tables, max_q, scale, window, *scales, block_m=block_m)
    ref = extend_attention_ref(q, k, v, starts, ctx, tables, max_q, scale, window, *scales)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gqa_and_head_dims(group, head_dim) -> None:
    # A fresh prompt (no prefix), a chunk after a cached prefix ending mid-block, a one-token row.
    check(*make([20, 9, 1], [20, 37, 50], 1, group, head_dim, 16, torch.float32, seed=group + head_dim))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_sizes_dtypes_and_mixed_sequences(block_size, dtype) -> None:
    chunks = [block_size, 3, block_size + 5, 0, 7]
    contexts = [block_size, 2 * block_size + 3, 3 * block_size + 5, 10, 7]
    check(*make(chunks, contexts, 2, 2, 64, block_size, dtype, seed=block_size))


def test_sliding_window() -> None:
    data = make([24, 6, 40], [24, 45, 70], 2, 2, 64, 16, torch.float32)
    check(*data, window=7)
    check(*data, window=33, block_m=32)


def test_fp8_cache_with_scales() -> None:
    data = make([12, 5], [30, 21], 2, 4, 128, 16, torch.bfloat16, fp8=True)
    check(*data, scales=(1.25, 0.5))


def test_twin_equals_naive_masked_softmax() -> None:
    q, k, v, starts, ctx, tables, max_q = make([5, 11], [20, 11], 2, 2, 32, 16, torch.float32, seed=3)
    out = extend_attention_ref(q, k, v, starts, ctx, tables, max_q, 0.25, None)
    for s in range(2):
        n, c = int(starts[s + 1] - starts[s]), int(ctx[s])
        keys = torch.cat([k[i] for i in tables[s].tolist()])[:c].repeat_interleave(2, dim=1)
        vals = torch.cat([v[i] for i in tables[s].tolist()])[:c].repeat_interleave(2, dim=1)
        qs = q[int(starts[s]):int(starts[s + 1])]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * 0.25
        allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        torch.testing.assert_close(out[int(starts[s]):int(starts[s + 1])], torch.einsum("hqk,khd->qhd", probs, vals),
                                   atol=1e-5, rtol=1e-5)


def test_extend_with_one_row_equals_decode() -> None:
    from kernels.decode_attention import decode_attention_ref

    q, k, v, starts, ctx, tables, max_q = make([1, 1, 1], [1, 17, 40], 2, 4, 64, 16, torch.float32, seed=5)
    a = extend_attention_triton(q, k, v, starts, ctx, tables, max_q, 0.125)
    b = decode_attention_ref(q, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused() -> None:
    q, k, v, starts, ctx, tables, max_q = make([3, 2], [3, 9], 2, 2, 64, 16, torch.float32)
    with pytest.raises(AssertionError, match="query_start"):
        extend_attention(q, k, v, starts[:-1], ctx, tables, max_q, 1.0)
    with pytest.raises(AssertionError, match="int32"):
        extend_attention(q, k, v, starts, ctx.long(), tables, max_q, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_heads_a_group_of_three(dtype) -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64; a fresh prompt and a chunk after a prefix.
    data = make([20, 9, 1], [20, 37, 50], 3, 3, 64, 16, dtype, seed=93)
    check(*data)
    check(*data, window=12)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_default_gqa_tiles_cover_every_head_of_a_group(group) -> None:
    # The default tile: 64 (token, head) rows of one KV head's group, so 64 / 32 / 16 / 16 / 8 tokens a program;
    # chunks longer and shorter than a tile, after a prefix, with a window.
    data = make([70, 9, 1], [70, 37, 90], 2, group, 64, 16, torch.float32, seed=7 * group)
    check(*data, block_m=None)
    check(*data, window=20, block_m=None)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_candidate_tiling_equals_the_twin(head_dim) -> None:
    # What tune_extend_tiles may pick on a GPU: more pages an iteration walk keys across page boundaries (each
    # key finds its own page), also from a sliding window's first page and with a group of 3.
    from kernels.extend_attention import candidate_tiles

    data = make([40, 9, 1], [40, 70, 33], 3, 3, head_dim, 16, torch.float32, seed=head_dim)
    for tiles in candidate_tiles(head_dim):
        scale = head_dim ** -0.5
        for window in (None, 21):
            out = extend_attention_triton(*data[:-1], data[-1], scale, window, tiles=tiles)
            ref = extend_attention_ref(*data[:-1], data[-1], scale, window)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{tiles} window {window}: {m}")


def test_tuned_tiles_are_used_for_their_problem_only(monkeypatch) -> None:
    import importlib

    ea = importlib.import_module("kernels.extend_attention")  # the package re-exports a function by that name
    data = make([20, 3], [20, 40], 2, 2, 64, 16, torch.float32, seed=11)
    tiles = ea.ExtendTiles(rows=64, pages=4, num_warps=8)
    monkeypatch.setitem(ea._tuned, ea._tiles_key(data[0], data[1], None), tiles)
    seen = []
    real = ea._extend_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["PAGES"], kw["num_warps"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ea, "_extend_kernel", Spy())
    extend_attention_triton(*data[:-1], data[-1], 0.125)
    extend_attention_triton(*data[:-1], data[-1], 0.125, 9)  # a window: another problem, default tiles
    assert seen == [(4, 8), (1, 4)]


def test_tuning_times_every_candidate_and_keeps_the_fastest_for_its_problem(monkeypatch) -> None:
    import importlib

    ea = importlib.import_module("kernels.extend_attention")
    monkeypatch.setattr(ea, "_tuned", {})
    q = torch.empty(1, 6, 64)
    kc = torch.empty(1, 16, 2, 64)
    res = ea.tune_extend_tiles(q, kc, None, tokens_per_seq=20, seqs=2, reps=1)
    assert len(res["ms"]) == len(ea.candidate_tiles(64)) and all(ms > 0 for ms in res["ms"].values())
    chosen = ea.ExtendTiles(**res["chosen"])
    assert res["ms"][str(chosen.__dict__)] == min(res["ms"].values())
    assert ea._tuned == {ea._tiles_key(q, kc, None): chosen}
