"""Prefill/extend attention over the paged cache: the new tokens of several sequences packed in one
step, each attending causally to its cached prefix plus its own chunk.

Contract: q [tokens, heads, head_dim], sequence s owns rows query_start[s]:query_start[s+1];
context_lens [seqs] int32 counts its tokens after this step (cached prefix + this chunk, whose K/V is
already stored in the cache); block_tables [seqs, max_blocks] int32. Query row i of sequence s sits at
position context_lens[s] - q_len_s + i and sees keys at positions <= its own (and, with sliding_window
w, > its own - w). max_query_len is the longest chunk (a host int for the launch grid). Caches as in
decode_attention. Returns [tokens, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_attention import dequant, gather_blocks
from kernels.store_kv import FP8_DTYPE
from kernels.triton_support import recording, tl, triton, upcast_dot


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                         sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin (the CPU path and the oracle)."""
    if out is None:
        out = torch.empty_like(q)
    bs = k_cache.shape[1]
    starts = query_start.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        n = q1 - q0
        if n == 0:
            continue
        table = block_tables[s, : -(-ctx // bs)]
        ks = dequant(gather_blocks(k_cache, table), k_scale, q.dtype)[:ctx]
        vs = dequant(gather_blocks(v_cache, table), v_scale, q.dtype)[:ctx]
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        if ctx == n and (sliding_window is None or n <= sliding_window):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
    return out


if triton is not None:

    # The block-table width changes from step to step: never specialised (see decode_attention._PER_STEP).
    @triton.jit(do_not_specialize=["stride_btb"])
    def _extend_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, qs_ptr, ctx_ptr, bt_ptr,
        scale_log2, k_scale, v_scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, HAS_WINDOW: tl.constexpr,
        IS_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """One program = one sequence x one tile of BLOCK_M of its query tokens x one KV head, with all GROUP
        query heads of that KV head (GQA-aware: each K/V page is read once for the whole group, not once per
        query head). Its BLOCK_M * GROUP_PAD rows are (token, head) pairs, token-major. It walks the sequence's
        keys PAGES pages at a time (BLOCK_N = PAGES * BLOCK_SIZE keys an iteration, each key finding its own
        page) from the first one its tokens may see (sliding window) to the last one its last token may see
        (causality), with an online softmax; no mask is ever materialised."""
        ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
        s = tl.program_id(0)
        tile = tl.program_id(1)
        kvh = tl.program_id(2)
        q0 = tl.load(qs_ptr + s)
        q_len = tl.load(qs_ptr + s + 1) - q0
        if tile * BLOCK_M >= q_len:
            return
        ctx = tl.load(ctx_ptr + s)
        r = tl.arange(0, ROWS)
        tok = tile * BLOCK_M + r // GROUP_PAD  # the row's query token within the chunk
        head = kvh * GROUP + r % GROUP_PAD
        d = tl.arange(0, D_PAD)
        BLOCK_N: tl.constexpr = BLOCK_SIZE * PAGES
        t = tl.arange(0, BLOCK_N)
        r_ok = (tok < q_len) & (r % GROUP_PAD < GROUP)
        d_ok = d < HEAD_DIM
        pos = ctx - q_len + tok  # absolute position of each row's token
        q_rows = (q0 + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        last_pos = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
        first_pos = 0
        if HAS_WINDOW:
            first_pos = tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for nb in range(first_pos // BLOCK_N, last_pos // BLOCK_N + 1):
            kpos = nb * BLOCK_N + t
            k_ok = kpos < ctx
            # Each key's page: one block-table entry per key (the same one BLOCK_SIZE times; cached loads).
            block_id = tl.load(bt_ptr + s * stride_btb + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            slot = kpos % BLOCK_SIZE
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + block_id[:, None] * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + block_id[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0)
            if IS_FP8:
                k = k.to(tl.float32) * k_scale
                v = v.to(tl.float32) * v_scale
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            visible = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] > pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that saw nothing yet stay at zero
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q0 + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class ExtendTiles:
    """One tiling of the extend kernel: (token, head) rows a program, KV pages an inner iteration, warps, stages."""
    rows: int = 64
    pages: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def block_m(self, group_pad: int) -> int:
        return max(1, self.rows // group_pad)


def default_tiles(head_dim: int) -> ExtendTiles:
    # head_dim 128 on 4 warps spills on sm_90 (tests/test_kernel_aot_compile.py); 8 warps do not.
    return ExtendTiles(num_warps=8 if head_dim > 64 else 4)


def candidate_tiles(head_dim: int) -> list[ExtendTiles]:
    """What tune_extend_tiles times on a GPU. Every one is compiled for sm_80/90/100 in make test with no spills
    (tests/test_kernel_aot_compile.py). At head_dim > 64 only 64-row tiles on 8 warps: 128 rows spilled there
    (16 B on sm_80 with one page, 8 B on sm_100 with two and FP8 KV)."""
    tiles = {default_tiles(head_dim)}
    for rows, pages, warps in ((64, 2, 4), (64, 2, 8), (64, 4, 8), (128, 1, 8), (128, 2, 8)):
        if head_dim > 64 and (warps < 8 or rows > 64):
            continue
        tiles.add(ExtendTiles(rows, pages, warps))
    return sorted(tiles, key=lambda x: (x.rows, x.pages, x.num_warps))


# Tiles chosen by timing on this process's GPU(s), by problem key (tune_extend_tiles); untuned keys use
# default_tiles. Like Triton's own autotune cache: a per-process cache of measurements, not configuration.
_tuned: dict[tuple, ExtendTiles] = {}


def _tiles_key(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None) -> tuple:
    return (q.device.index, q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, k_cache.dtype, k_cache.shape[1],
            sliding_window is not None)


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                            sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                            out: torch.Tensor | None = None, block_m: int | None = None,
                            tiles: ExtendTiles | None = None) -> torch.Tensor:
    """Flash attention over the paged cache for packed prefill chunks. tiles: the tiling (default: the one
    tune_extend_tiles chose for this problem, else default_tiles: 64 rows of (token, head) pairs, so 32 tokens
    for a group of 2, 16 for 3 or 4, 8 for 8; one page an iteration). block_m overrides the query tokens a
    program (tests)."""
    check_extend_attention(q, k_cache, v_cache, query_start, context_lens, block_tables)
    assert triton is not None, "triton is not installed"
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 16"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q"
    seqs = context_lens.shape[0]
    if seqs == 0 or tokens == 0:
        return out
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    if tiles is None:
        tiles = _tuned.get(_tiles_key(q, k_cache, sliding_window)) or default_tiles(head_dim)
    if block_m is None:
        block_m = tiles.block_m(group_pad)
    assert block_m & (block_m - 1) == 0 and block_m * group_pad >= 16, "block_m: a power of 2, >= 16 rows a program"
    assert tiles.pages & (tiles.pages - 1) == 0, "pages: a power of 2"
    grid = (seqs, triton.cdiv(max(1, max_query_len), block_m), kv_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, query_start, context_lens, block_tables,
        scale * 1.4426950408889634, k_scale, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_SIZE=block_size, PAGES=tiles.pages,
        HAS_WINDOW=sliding_window is not None, IS_FP8=k_cache.dtype == FP8_DTYPE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=upcast_dot(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def median_ms(launch, dev: torch.device, reps: int) -> float:
    """Median milliseconds of reps launches: CUDA events on a GPU, the host clock elsewhere."""
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            launch()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def tune_extend_tiles(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None = None,
                      tokens_per_seq: int = 512, seqs: int = 4, reps: int = 5) -> dict:
    """Time every candidate tiling on this GPU for the problem q / k_cache describe (their shapes and dtypes;
    the data is made up here: 4 prompts of 512 tokens in a private cache) and keep the fastest for it. The
    engine calls this once at warm-up, before it reports ready, so no serving step waits on a tuning run.
    Returns {"chosen": ..., "ms": {tiles: ms}} for the start-up log. (On CPU it runs too, under Triton's
    interpreter, timed by the host clock: how the tests exercise it.)"""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    blocks_per_seq = -(-tokens_per_seq // block_size)
    kc = torch.randn(seqs * blocks_per_seq, block_size, kv_heads, head_dim, device=dev).to(k_cache.dtype)
    vc = torch.randn_like(kc, dtype=torch.float32).to(k_cache.dtype)
    qq = torch.randn(seqs * tokens_per_seq, heads, head_dim, device=dev, dtype=q.dtype)
    starts = torch.arange(0, seqs + 1, device=dev, dtype=torch.int32) * tokens_per_seq
    ctx = torch.full((seqs,), tokens_per_seq, device=dev, dtype=torch.int32)
    tables = torch.arange(seqs * blocks_per_seq, device=dev, dtype=torch.int32).view(seqs, blocks_per_seq)
    out = torch.empty_like(qq)
    timings: dict[ExtendTiles, float] = {}
    for tiles in candidate_tiles(head_dim):
        def launch() -> None:
            extend_attention_triton(qq, kc, vc, starts, ctx, tables, tokens_per_seq, head_dim ** -0.5,
                                    sliding_window, out=out, tiles=tiles)
        launch()  # compiles
        timings[tiles] = median_ms(launch, dev, reps)
    chosen = min(timings, key=timings.get)
    _tuned[_tiles_key(q, k_cache, sliding_window)] = chosen
    return {"chosen": chosen.__dict__, "ms": {str(t.__dict__): round(ms, 4) for t, ms in timings.items()}}


def check_extend_attention(q, k_cache, v_cache, query_start, context_lens, block_tables) -> None:
    assert q.dim() == 3, f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert q.shape[2] == k_cache.shape[3], f"head_dim of q ({q.shape[2]}) and cache ({k_cache.shape[3]}) differ"
    assert q.shape[1] % k_cache.shape[2] == 0, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    seqs = context_lens.shape[0]
    assert query_start.shape == (seqs + 1,), "query_start must be [seqs + 1]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == seqs, "block_tables must be [seqs, max_blocks]"
    for t in (query_start, context_lens, block_tables):
        assert t.dtype == torch.int32, "query_start/context_lens/block_tables must be int32"
    assert k_cache.dtype in (q.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs q dtype {q.dtype}"


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                     sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    if q.is_cuda:
        return extend_attention_triton(q, k_cache, v_cache, query_start, context_lens, block_tables, max_query_len,
                                       scale, sliding_window, k_scale, v_scale, out=out)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        extend_attention_triton(q, k_cache, v_cache, query_start, context_lens, block_tables, max_query_len, scale,
                                sliding_window, k_scale, v_scale, out=torch.empty_like(q))
    check_extend_attention(q, k_cache, v_cache, query_start, context_lens, block_tables)
    return extend_attention_ref(q, k_cache, v_cache, query_start, context_lens, block_tables, max_query_len, scale,
                                sliding_window, k_scale, v_scale, out)
