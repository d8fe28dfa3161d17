"""Triton store-KV (with FP8), fused residual-add + RMSNorm and rotary, against their torch twins under
Triton's interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton, rms_norm, rms_norm_ref, rms_norm_triton
from kernels.rotary import rotary, rotary_ref, rotary_triton
from kernels.store_kv import FP8_DTYPE, FP8_MAX, store_kv, store_kv_ref, store_kv_triton
from kernels.triton_support import interpreting
from shared.models.model_config import RopeConfig
from shared.models.rope import cos_sin_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16: the interpreter rounds float32 -> bf16 by truncation (a GPU to nearest), so results may differ by an ulp.
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 3e-2}


# ------------------------------------------------------------------------------------------------ store-KV


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_twin_and_skips_minus_one(block_size, dtype) -> None:
    g = torch.Generator().manual_seed(block_size)
    tokens, kv_heads, head_dim = 7, 2, 96
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([0, 5, -1, block_size, 3 * block_size + 7, -1, 2 * block_size - 1])
    caches = [torch.full((4, block_size, kv_heads, head_dim), 9.0, dtype=dtype) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, kv_heads, head_dim)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((flat[untouched] == 9.0).all())


def test_store_kv_fp8_quantizes_with_scale_and_saturates() -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 64, generator=g) * 3
    v = torch.randn(5, 2, 64, generator=g) * 3
    k[0, 0, 0], v[1, 1, 1] = 10_000.0, -10_000.0  # far beyond 448 * scale: saturates, no inf/nan
    slots = torch.tensor([3, 0, 17, -1, 30])
    got = [torch.zeros(2, 16, 2, 64, dtype=FP8_DTYPE) for _ in range(2)]
    want = [torch.zeros(2, 16, 2, 64, dtype=FP8_DTYPE) for _ in range(2)]
    store_kv_triton(k, v, *got, slots, k_scale=0.5, v_scale=2.0)
    store_kv_ref(k, v, *want, slots, k_scale=0.5, v_scale=2.0)
    for a, b in zip(got, want):
        a, b = a.float(), b.float()
        if interpreting():
            # Triton 3.9's interpreter rounds float32 -> e4m3 wrongly just below a power of two (7.95 -> 4.0
            # instead of 8.0) and flushes subnormals; a GPU converts exactly like torch. Everything else equal.
            same = (a == b).float().mean()
            assert same > 0.97 and bool(((a - b).abs() <= b.abs() / 2 + 2**-6).all()), same
        else:
            assert torch.equal(a, b)
    assert got[0].float().abs().max() == FP8_MAX and got[1].float().abs().max() == FP8_MAX
    assert torch.isfinite(got[0].float()).all()


def test_store_kv_refuses_bad_shapes() -> None:
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(AssertionError, match="slot_mapping"):
        store_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache, cache.clone(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(AssertionError, match="does not fit"):
        store_kv(torch.zeros(3, 4, 64), torch.zeros(3, 4, 64), cache, cache.clone(), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("hidden", [96, 320, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(hidden, dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    res = torch.randn(5, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) / 10).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])
    want_norm, want_sum = add_rms_norm_ref(x, res, w, 1e-6)
    got_norm, got_sum = add_rms_norm_triton(x.clone(), res.clone(), w, 1e-6)
    # The add happens in the activation dtype, as in transformers (the interpreter rounds bf16 by truncation,
    # a GPU to nearest: one ulp apart at most).
    torch.testing.assert_close(got_sum, want_sum, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_norm, want_norm, atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_over_head_dim_of_a_3d_view() -> None:
    # Qwen3's q/k norm: rows of head_dim inside [tokens, heads, head_dim] views of a fused projection.
    qkv = torch.randn(4, 3 * 8 * 64)
    q = qkv[:, : 8 * 64].view(4, 8, 64)
    w = torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), atol=1e-6, rtol=1e-6)


def test_rms_norm_refuses_mismatched_weight() -> None:
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


# ------------------------------------------------------------------------------------------------ rotary

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, type="linear", factor=4.0),
    "llama3": RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192),
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_views_of_a_fused_qkv(rope, head_dim, dtype) -> None:
    table = cos_sin_cache(ROPES[rope], head_dim, 40_000)
    heads, kv_heads, tokens = 4, 2, 6
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 17, 4095, 8191, 39_999])
    got = qkv.clone()
    q, k = got[:, : heads * head_dim].view(tokens, heads, head_dim), got[:, heads * head_dim:][:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    rotary_triton(q, k, positions, table)
    want = qkv.clone()
    q2, k2 = want[:, : heads * head_dim].view(tokens, heads, head_dim), want[:, heads * head_dim:][:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    rotary_ref(q2, k2, positions, table)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    assert torch.equal(got[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v untouched


def test_rotary_refuses_bad_positions() -> None:
    table = cos_sin_cache(ROPES["default"], 64, 16)
    with pytest.raises(AssertionError, match="positions"):
        rotary(torch.zeros(3, 2, 64), torch.zeros(3, 1, 64), torch.zeros(2, dtype=torch.long), table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_heads_nine_over_three(dtype) -> None:
    # SmolLM2-135M's 9 query / 3 KV heads of 64 (head counts padded to 16 and 4 in the kernels) and hidden 576.
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 5
    g = torch.Generator().manual_seed(576)
    table = cos_sin_cache(ROPES["default"], head_dim, 64)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 17, 40, 63])
    results = []
    for rot in (rotary_triton, rotary_ref):
        x = qkv.clone()
        q = x[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = x[:, heads * head_dim:][:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
        rot(q, k, positions, table)
        results.append(x)
    torch.testing.assert_close(results[0], results[1], atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([0, 17, -1, 31, 5])
    caches = [torch.zeros(3, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    x, w = torch.randn(tokens, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])


# ------------------------------------------------------------------------------------------------ silu * mul


@pytest.mark.parametrize("inter", [64, 1536, 3000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_twin(inter, dtype) -> None:
    from kernels.silu_mul import silu_mul_ref, silu_mul_triton

    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(5, 2 * inter, generator=g) * 3).to(dtype)
    got, want = silu_mul_triton(x), silu_mul_ref(x)
    assert got.shape == (5, inter) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    assert silu_mul_triton(x[:0]).shape == (0, inter)


# ------------------------------------------------------------------------------------ fused q/k norm + rotary + store


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (9, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_rope_store_matches_the_unfused_twins(norm, fp8, heads, kv_heads, head_dim, dtype) -> None:
    from kernels.qk_rope_store import qk_rope_store_ref, qk_rope_store_triton

    g = torch.Generator().manual_seed(heads * head_dim + norm + 2 * fp8)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qw = kw = None
    if norm:
        qw, kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype), (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    table = cos_sin_cache(ROPES["llama3"], head_dim, 4096)
    positions = torch.tensor([0, 1, 17, 300, 4095, 9])
    slots = torch.tensor([0, 5, -1, 16, 47, 31])
    cache_dtype = FP8_DTYPE if fp8 else dtype
    caches = [torch.zeros(3, 16, kv_heads, head_dim, dtype=cache_dtype) for _ in range(4)]
    got = qk_rope_store_triton(qkv.clone(), heads, kv_heads, head_dim, qw, kw, 1e-6, positions, table, caches[0],
                               caches[1], slots, 0.5, 2.0)
    want = qk_rope_store_ref(qkv.clone(), heads, kv_heads, head_dim, qw, kw, 1e-6, positions, table, caches[2],
                             caches[3], slots, 0.5, 2.0)
    tol = TOL[dtype] * 4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        a, b = a.float(), b.float()
        if fp8:  # the interpreter's e4m3 rounding (see test_store_kv_fp8_quantizes_with_scale_and_saturates)
            assert bool(((a - b).abs() <= b.abs() / 2 + 2**-6 + tol * 8).all())
        else:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rope_store_twin_with_per_step_rows_equals_the_unfused_formula(norm, dtype) -> None:
    """The CPU path's rows and kept slots computed once per step (shared/models/llama.py) give, bit for bit, what
    the rotate-half formula (x1 cos - x2 sin, x2 cos + x1 sin) and a per-layer slot filter give."""
    from kernels.qk_rope_store import qk_rope_store_ref
    from kernels.rotary import rope_rows
    from kernels.store_kv import kept_slots

    g = torch.Generator().manual_seed(7 + norm)
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qw = kw = None
    if norm:
        qw, kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype), (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    table = cos_sin_cache(ROPES["llama3"], head_dim, 4096)
    positions = torch.tensor([0, 1, 17, 300, 4095, 9])
    slots = torch.tensor([0, 5, -1, 16, 47, 31], dtype=torch.int32)
    caches = [torch.zeros(3, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    got = qk_rope_store_ref(qkv.clone(), heads, kv_heads, head_dim, qw, kw, 1e-6, positions, table, caches[0],
                            caches[1], slots, rope=rope_rows(table, positions, dtype), kept=kept_slots(slots))
    # The formula written out, as the twin computed it before the per-step rows.
    x = qkv.clone()
    q = x[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = x[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = x[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    if norm:
        q, k = rms_norm_ref(q, qw, 1e-6), rms_norm_ref(k, kw, 1e-6)
    cs = table[positions]
    half = head_dim // 2
    for t in (q, k):
        cos, sin = cs[:, None, :half].to(dtype), cs[:, None, half:].to(dtype)
        t1, t2 = t[..., :half], t[..., half:]
        new1 = t1 * cos - t2 * sin
        t2.copy_(t2 * cos + t1 * sin)
        t1.copy_(new1)
    keep = slots >= 0
    caches[2].view(-1, kv_heads, head_dim)[slots[keep].long()] = k[keep]
    caches[3].view(-1, kv_heads, head_dim)[slots[keep].long()] = v[keep]
    assert torch.equal(got, q)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert bool(caches[0].abs().sum() > 0)
