"""The C++ CPU kernels (kernels/cpu/) against their torch twins, which stay the oracle: small shapes, float32 and
bf16, several row counts, block boundaries, slot -1. The extension must build here (g++ is part of the test
image): a missing build fails these tests rather than skipping them, and the fallback has its own test."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernels import AttentionMetadata, paged_attention as paged_attention_ref
from kernels.cpu import paged_attention as cpp_attention
from kernels.cpu import qk_rope_store as cpp_rope
from kernels.cpu import rms_norm as cpp_norm
from kernels.cpu import silu_mul as cpp_silu
from kernels.cpu import extension
from kernels.cpu.extension import native_status
from kernels.qk_rope_store import qk_rope_store_ref
from kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from kernels.silu_mul import silu_mul_ref
from shared.models.rope import cos_sin_cache
from shared.models.model_config import RopeConfig

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    ok, why = native_status()
    assert ok, f"the C++ CPU kernels did not load: {why}"


def close(out: torch.Tensor, ref: torch.Tensor, exact_share: float = 0.98) -> None:
    """Equal within the dtype's rounding; and in bf16 almost every element bit-identical (the kernels round where
    the twins round; the rest differ by float32 summation order, one bf16 ulp)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        assert (out == ref).float().mean().item() >= exact_share, (out == ref).float().mean().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_and_add_rms_norm(dtype, rows, hidden) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    close(cpp_norm.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    ref_out, ref_res = add_rms_norm_ref(x.clone(), res.clone(), w, 1e-5)
    out, new_res = cpp_norm.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact
    close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_mul(dtype, rows) -> None:
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    close(cpp_silu.silu_mul(x), silu_mul_ref(x))


def _caches(blocks, block_size, kv_heads, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype),
            torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
def test_qk_rope_store(dtype, qk_norm, heads, kv_heads) -> None:
    d, block_size, blocks = 64, 16, 6
    table = cos_sin_cache(RopeConfig(theta=10000.0), d, 256)
    g = torch.Generator().manual_seed(heads + 10 * qk_norm)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    # Positions at block edges; slots at both ends of blocks, and -1 (not stored).
    positions = torch.tensor([0, 15, 16, 17, 31, 32, 200], dtype=torch.int32)
    slots = torch.tensor([0, 15, 16, -1, 47, 48, 95], dtype=torch.int32)
    qw = (1 + torch.randn(d, generator=g) / 4).to(dtype) if qk_norm else None
    kw = (1 + torch.randn(d, generator=g) / 4).to(dtype) if qk_norm else None
    kc, vc = _caches(blocks, block_size, kv_heads, d, dtype, 1)
    kc2, vc2 = kc.clone(), vc.clone()
    q_ref = qk_rope_store_ref(qkv.clone(), heads, kv_heads, d, qw, kw, 1e-6, positions, table, kc, vc, slots)
    q = cpp_rope.qk_rope_store(qkv.clone(), heads, kv_heads, d, qw, kw, 1e-6, positions, table, kc2, vc2, slots)
    close(q, q_ref.contiguous())
    close(kc2, kc, exact_share=0.999)
    assert torch.equal(vc2, vc)
    untouched = kc2.view(-1, kv_heads, d)[16 + 1]  # slot 17 was never written (token 3's slot is -1)
    assert torch.equal(untouched, _caches(blocks, block_size, kv_heads, d, dtype, 1)[0].view(-1, kv_heads, d)[17])


def _meta(chunks: list[tuple[int, int]], decode_lens: list[int], block_size: int, blocks: int, window=None,
          seed: int = 0) -> AttentionMetadata:
    """chunks: (new rows, context) per prompt chunk; decode_lens: context per decode row. Shuffled block ids,
    tables padded with garbage past each sequence's blocks."""
    g = torch.Generator().manual_seed(seed)
    width = max([-(-c // block_size) for _, c in chunks] + [-(-c // block_size) for c in decode_lens] + [1])

    def tables(n: int) -> torch.Tensor:
        return torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(n)]).int() if n else \
            torch.zeros(0, width, dtype=torch.int32)

    starts = [0]
    for n, _ in chunks:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1] + len(decode_lens), dtype=torch.int32), num_prefill_tokens=starts[-1],
        prefill_query_start=torch.tensor(starts, dtype=torch.int32),
        prefill_context_lens=torch.tensor([c for _, c in chunks], dtype=torch.int32), prefill_block_tables=tables(len(chunks)),
        max_prefill_query_len=max([n for n, _ in chunks], default=0),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32), decode_block_tables=tables(len(decode_lens)),
        sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("case", ["decode1", "decode8", "mixed", "window"])
def test_paged_attention(dtype, heads, kv_heads, case) -> None:
    block_size, d, blocks = 16, 64, 40
    chunks, lens, window = {
        "decode1": ([], [37], None),
        "decode8": ([], [1, 15, 16, 17, 32, 33, 100, 160], None),
        "mixed": ([(3, 3), (4, 20), (2, 49)], [16, 17, 64], None),
        "window": ([(5, 40)], [1, 20, 70, 96], 19),
    }[case]
    meta = _meta(chunks, lens, block_size, blocks, window, seed=heads)
    kc, vc = _caches(blocks, block_size, kv_heads, d, dtype, heads)
    q = torch.randn(meta.num_prefill_tokens + len(lens), heads, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale = d ** -0.5
    ref = paged_attention_ref(q, None, None, kc, vc, meta, scale)
    out = cpp_attention.paged_attention(q, kc, vc, meta, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(2, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.kvmesh_cpu.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6)
    meta = _meta([], [40], 16, 4)
    kc, vc = _caches(4, 16, 2, 64, torch.float32, 0)
    with pytest.raises(RuntimeError, match="blocks of its table"):  # 40 tokens need 3 blocks; the table has 3, not 2
        cpp_attention.paged_attention(torch.randn(1, 4, 64), kc, vc,
                                      AttentionMetadata(**{**meta.__dict__, "decode_block_tables":
                                                           meta.decode_block_tables[:, :2]}), 0.125)


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = "from kernels.cpu.extension import native_status; ok, why = native_status(); print(ok, '|', why)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.strip()


def test_fallback_when_turned_off_or_no_compiler() -> None:
    assert _status_in_subprocess({"KVMESH_CPU_KERNELS": "torch"}) == "False | KVMESH_CPU_KERNELS=torch"
    out = _status_in_subprocess({"CXX": "/nonexistent/c++"})
    assert out.startswith("False |") and "compiler" in out, out


def test_a_build_killed_half_way_does_not_hang_later_loads() -> None:
    """torch's FileBaton lock file left by a build that died (Ctrl-C in `make venv`) made every later worker start
    wait on it for ever; the flock holder removes it as stale. Real build folder, real subprocess load."""
    ok, why = native_status()
    assert ok, why
    build_dir = Path(why.rsplit(" from ", 1)[1])
    (build_dir / "lock").touch()
    t0 = time.monotonic()
    out = _status_in_subprocess({})
    assert out.startswith("True |"), out
    assert time.monotonic() - t0 < 120 and not (build_dir / "lock").exists()


def test_checkouts_share_one_build_compiled_from_staged_sources() -> None:
    """ninja keys its rules on source paths: compiling from the checkout made each clone or worktree rebuild the
    shared cache folder in turn. The build compiles copies under the (content-hashed) folder instead."""
    ok, why = native_status()
    assert ok, why
    build_dir = Path(why.rsplit(" from ", 1)[1])
    ninja = (build_dir / "build.ninja").read_text()
    assert str(build_dir / "src" / "rms_norm.cpp") in ninja
    assert str(Path(extension.__file__).parent / "rms_norm.cpp") not in ninja
    for p in extension.sources():
        assert (build_dir / "src" / p.name).read_bytes() == p.read_bytes()


def test_the_build_lock_removes_a_stale_torch_lock(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()
    with extension._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
