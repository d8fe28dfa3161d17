"""Triton paged decode attention (split-KV) against its torch twin, under Triton's interpreter on CPU; and the
twin against a naive softmax(qK^T)V per sequence."""
from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (decode_attention, decode_attention_ref, decode_attention_triton,
                                      default_num_splits)
from kernels.store_kv import FP8_DTYPE

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make(batch, kv_heads, group, head_dim, block_size, dtype, max_blocks=6, num_blocks=40, fp8=False, seed=0,
         lens=None):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    if fp8:
        k, v = (k / 2).to(FP8_DTYPE), (v / 2).to(FP8_DTYPE)
    else:
        k, v = k.to(dtype), v.to(dtype)
    # Shuffled, non-contiguous block ids; entries past each sequence's end are garbage the kernel must ignore.
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)]).int()
    if lens is None:
        lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=g).tolist()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k, v, tables, ctx


def check(q, k, v, tables, ctx, window=None, scales=(1.0, 1.0), splits=None):
    scale = q.shape[-1] ** -0.5
    out = decode_attention_triton(q, k, v, tables, ctx, scale, window, *scales, num_splits=splits)
    ref = decode_attention_ref(q, k, v, tables, ctx, scale, window, *scales)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gqa_ratios_and_head_dims(group, head_dim) -> None:
    check(*make(3, 2, group, head_dim, 16, torch.float32, seed=group * head_dim))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_sizes_and_dtypes(block_size, dtype) -> None:
    # Contexts at and around block boundaries, mixed in one batch.
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1, 5 * block_size + 3]
    check(*make(len(lens), 2, 4, 64, block_size, dtype, lens=lens))


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_split_counts_including_more_splits_than_pages(splits) -> None:
    check(*make(4, 2, 2, 64, 16, torch.float32, lens=[1, 17, 40, 96], seed=splits), splits=splits)


def test_sliding_window() -> None:
    q, k, v, tables, ctx = make(4, 2, 4, 64, 16, torch.float32, lens=[5, 20, 50, 96])
    check(q, k, v, tables, ctx, window=19, splits=3)
    check(q, k, v, tables, ctx, window=1)


def test_fp8_cache_with_scales() -> None:
    q, k, v, tables, ctx = make(3, 2, 4, 128, 16, torch.bfloat16, fp8=True)
    check(q, k, v, tables, ctx, scales=(1.5, 0.75), splits=2)
    q16 = q.half()
    check(q16, k, v, tables, ctx, scales=(1.5, 0.75))


def test_twin_equals_naive_attention() -> None:
    q, k, v, tables, ctx = make(5, 2, 4, 32, 16, torch.float32)
    out = decode_attention_ref(q, k, v, tables, ctx, 0.3, None)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        keys = torch.cat([k[i] for i in tables[b].tolist()])[:n]  # [n, kv_heads, d]
        vals = torch.cat([v[i] for i in tables[b].tolist()])[:n]
        keys = keys.repeat_interleave(4, dim=1)
        vals = vals.repeat_interleave(4, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], keys) * 0.3
        expect = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
        torch.testing.assert_close(out[b], expect, atol=1e-5, rtol=1e-5)


def test_grid_depends_on_shapes_only() -> None:
    assert default_num_splits(1, 8, 128) == 32  # batch 1: the long context is spread over many programs
    assert default_num_splits(64, 8, 128) == 1  # a full batch fills the GPU without splitting
    assert default_num_splits(1, 8, 2) == 1  # never more splits than groups of pages


def test_bad_inputs_are_refused() -> None:
    q, k, v, tables, ctx = make(2, 2, 2, 64, 16, torch.float32)
    with pytest.raises(AssertionError, match="multiple of"):
        decode_attention(q[:, :3], k, v, tables, ctx, 1.0)
    with pytest.raises(AssertionError, match="int32"):
        decode_attention(q, k, v, tables.long(), ctx, 1.0)
    with pytest.raises(AssertionError, match="head_dim"):
        decode_attention(q[..., :32], k, v, tables, ctx, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_smollm2_heads_a_group_of_three(dtype, fp8) -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads (a group that is not a power of 2, padded to 16 rows), head_dim 64.
    lens = [1, 15, 16, 33, 70, 96]
    data = make(len(lens), 3, 3, 64, 16, dtype, lens=lens, fp8=fp8, seed=9)
    check(*data, scales=(1.5, 0.75) if fp8 else (1.0, 1.0))
    check(*data, window=20, splits=3)
