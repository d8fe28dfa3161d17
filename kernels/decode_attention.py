"""Paged decode attention: one query token per sequence against its block table.

Contract: q [batch, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
(model dtype, or float8_e4m3fn dequantized with k_scale / v_scale); block_tables [batch, max_blocks]
int32 (entries past a sequence's last block are ignored); context_lens [batch] int32, the number of
tokens each query attends to, its own included (its K/V is already stored). With sliding_window w
a query at position p sees keys in (p - w, p]. Returns [batch, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8_bytes import indexable
from kernels.store_kv import FP8_DTYPE


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim]: whole blocks copied at once (much faster on
    CPU than gathering slot by slot); an FP8 cache's as bytes (kernels/fp8_bytes.py)."""
    rows = indexable(cache).view(cache.shape[0], -1).index_select(0, block_ids.long())
    return rows.view(cache.dtype).view(-1, *cache.shape[2:])


def dequant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale if x.dtype == FP8_DTYPE else x


def group_by_length(lens: list[int], min_group: int = 8, max_waste: float = 1.3) -> list[list[int]]:
    """Indices in groups of similar length: each group is padded to its longest member, and on CPU
    the padded K/V copy is the cost of decode attention at large batch."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) < min_group or lens[i] <= max_waste * lens[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [b] rows of the batch in this group
    table: torch.Tensor  # [b * blocks] their block ids, flattened
    blocks: int  # blocks per row (the group's longest context)
    mask: torch.Tensor  # [b, 1, 1, blocks * block_size] additive: 0 attend, -inf skip


def decode_groups(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  sliding_window: int | None, dtype: torch.dtype) -> list[DecodeGroup]:
    """The twin's per-step work that does not depend on the layer: rows grouped by context length, their
    block ids and additive masks. The CPU path computes it once per step (AttentionMetadata.cpu_cache)."""
    lens = context_lens.tolist()
    groups = []
    for group in group_by_length(lens):
        rows = torch.tensor(group, dtype=torch.long, device=block_tables.device)
        nblk = -(-max(lens[i] for i in group) // block_size)
        ctx = context_lens[rows].long()[:, None]
        k_pos = torch.arange(nblk * block_size, device=block_tables.device)[None, :]
        allowed = k_pos < ctx
        if sliding_window is not None:
            allowed &= k_pos > ctx - 1 - sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=block_tables.device).masked_fill_(~allowed, float("-inf"))
        groups.append(DecodeGroup(rows, block_tables[rows, :nblk].reshape(-1), nblk, mask[:, None, None, :]))
    return groups


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         groups: list[DecodeGroup] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin (the CPU path and the oracle). groups: decode_groups(...) computed once per step."""
    if out is None:
        out = torch.empty_like(q)
    bs = k_cache.shape[1]
    if groups is None:
        groups = decode_groups(block_tables, context_lens, bs, sliding_window, q.dtype)
    for g in groups:
        b = g.rows.shape[0]
        ks = dequant(gather_blocks(k_cache, g.table), k_scale, q.dtype).view(b, g.blocks * bs, *k_cache.shape[2:])
        vs = dequant(gather_blocks(v_cache, g.table), v_scale, q.dtype).view(b, g.blocks * bs, *v_cache.shape[2:])
        if b == 1:  # one row: the flash kernel's single call beats the matmuls' eight
            o = F.scaled_dot_product_attention(q[g.rows].unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                               attn_mask=g.mask, scale=scale, enable_gqa=True).squeeze(2)
        else:
            o = _attend_one_query(q[g.rows], ks, vs, g.mask, scale)
        out[g.rows] = o
    return out


def _attend_one_query(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """q [b, heads, d], ks / vs [b, tokens, kv_heads, d], mask [b, 1, 1, tokens] -> [b, heads, d].

    Two batched matmuls and a softmax, not F.scaled_dot_product_attention: for one query row per sequence, torch's
    CPU flash kernel costs 5-9x as much per call at batch 8-32 (measured on this project's 2-core CPU, SmolLM2's
    9 heads over 3 KV heads, bf16, ~110-180 tokens), and decode attention was a third of a batch-8 step; a whole
    engine decodes 1.45x / 1.33x faster at batch 8 / 32. A group of one
    row keeps the flash kernel: there its one call beat these eight ops in the engine (0.89x). Its
    numerics: scores and softmax in float32 as the flash kernel's, probabilities rounded to the model dtype for
    the product with V (errors against a float32 reference measured equal to the flash kernel's)."""
    b, heads, d = q.shape
    tokens, kv_heads = ks.shape[1], ks.shape[2]
    group = heads // kv_heads  # query head h reads KV head h // group (enable_gqa's mapping)
    k_t = ks.permute(0, 2, 3, 1).reshape(b * kv_heads, d, tokens).float()
    scores = torch.bmm(q.reshape(b * kv_heads, group, d).float(), k_t).view(b, kv_heads, group, tokens)
    probs = torch.softmax(scores * scale + mask.view(b, 1, 1, tokens), dim=-1).to(vs.dtype)
    v = vs.transpose(1, 2).reshape(b * kv_heads, tokens, d)
    return torch.bmm(probs.view(b * kv_heads, group, tokens), v).view(b, heads, d)


from kernels.triton_support import recording, tl, triton, upcast_dot


if triton is not None:

    # Arguments that change from step to step (the split count, the block-table width, the workspace strides
    # that follow the split count) are never specialised: Triton would otherwise compile a new variant for a
    # value of 1 or a multiple of 16, blocking the engine thread while serving.
    _PER_STEP = ["num_splits", "stride_btb", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]

    @triton.jit(do_not_specialize=_PER_STEP)
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ws_ptr, lse_ws_ptr, out_ptr,
        scale_log2, k_scale, v_scale, window, num_splits,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_btb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_outb, stride_outh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HAS_WINDOW: tl.constexpr, IS_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Stage 1: one program = one sequence x one KV head (all its query heads) x one split of the
        sequence's pages. Writes the split's normalised partial output and its log2-sum-exp."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - window, 0)
        first_blk = lo // BLOCK_SIZE
        n_blk = tl.cdiv(ctx, BLOCK_SIZE) - first_blk
        per_split = tl.cdiv(n_blk, num_splits)
        start = first_blk + split * per_split
        end = tl.minimum(start + per_split, first_blk + n_blk)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, BLOCK_SIZE)
        heads = kvh * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for blk in range(start, end):
            block_id = tl.load(bt_ptr + b * stride_btb + blk).to(tl.int64)
            pos = blk * BLOCK_SIZE + t
            valid = (pos < ctx) & (pos >= lo)
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + block_id * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + block_id * stride_vb + t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0)
            if IS_FP8:
                k = k.to(tl.float32) * k_scale
                v = v.to(tl.float32) * v_scale
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        has = end > start
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if num_splits == 1:  # the whole context in this program: the result itself, and no reduce launch
            tl.store(out_ptr + b * stride_outb + heads[:, None] * stride_outh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(has & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(o_ws_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
                     mask=g_ok[:, None] & d_ok[None, :])
            tl.store(lse_ws_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)

    @triton.jit(do_not_specialize=_PER_STEP)
    def _decode_reduce_kernel(
        o_ws_ptr, lse_ws_ptr, out_ptr, num_splits,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_outb, stride_outh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    ):
        """Stage 2: one program = one sequence x one query head; combines the splits by their log-sum-exp,
        online over a runtime count of splits (one compiled variant whatever the split count)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([D_PAD], tl.float32)
        for sp in range(0, num_splits):
            lse = tl.load(lse_ws_ptr + b * stride_lb + h * stride_lh + sp)
            o = tl.load(o_ws_ptr + b * stride_ob + h * stride_oh + sp * stride_os + d, mask=d_ok, other=0.0)
            m_new = tl.maximum(m, lse)
            # A split that saw no key has lse -inf and weighs nothing; until one did, m stays -inf.
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            acc = acc * alpha + o * w
            total = total * alpha + w
            m = m_new
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_outb + h * stride_outh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(batch: int, kv_heads: int, max_blocks: int, target_programs: int = 256,
                       min_blocks_per_split: int = 4) -> int:
    """Splits per sequence from shapes only (never from context lengths, so a CUDA graph captured for a
    batch bucket stays valid when contexts grow): enough programs to fill a GPU at small batch, and at
    least a few pages per split so the reduce stays cheap."""
    want = -(-target_programs // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_blocks // min_blocks_per_split), 64))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-decoding over the paged cache (split-KV + reduce); the launch grid depends on shapes only."""
    check_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    assert triton is not None, "triton is not installed"
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    # tl.dot needs K >= 16: the probabilities x V product runs over a block's tokens.
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 16"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    group = heads // kv_heads
    splits = num_splits or default_num_splits(batch, kv_heads, block_tables.shape[1])
    d_pad = max(16, triton.next_power_of_2(head_dim))
    # One split (a full batch): the split kernel writes the result, there is no workspace and no reduce.
    ws = 1 if splits == 1 else splits
    o_ws = torch.empty(batch if splits > 1 else 1, heads, ws, d_pad, dtype=torch.float32, device=q.device)
    lse_ws = torch.empty(batch if splits > 1 else 1, heads, ws, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q"
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, o_ws, lse_ws, out,
        scale * 1.4426950408889634, k_scale, v_scale, sliding_window or 0, splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        o_ws.stride(0), o_ws.stride(1), o_ws.stride(2),
        lse_ws.stride(0), lse_ws.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None, IS_FP8=k_cache.dtype == FP8_DTYPE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=upcast_dot(q.dtype),
    )
    if splits == 1:
        return out
    _decode_reduce_kernel[(batch, heads)](
        o_ws, lse_ws, out, splits,
        o_ws.stride(0), o_ws.stride(1), o_ws.stride(2),
        lse_ws.stride(0), lse_ws.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad,
    )
    return out


def check_decode_attention(q, k_cache, v_cache, block_tables, context_lens) -> None:
    assert q.dim() == 3, f"q must be [batch, heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert q.shape[2] == k_cache.shape[3], f"head_dim of q ({q.shape[2]}) and cache ({k_cache.shape[3]}) differ"
    assert q.shape[1] % k_cache.shape[2] == 0, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0], "block_tables must be [batch, max_blocks]"
    assert context_lens.shape == (q.shape[0],), "context_lens must be [batch]"
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32, "block_tables/context_lens must be int32"
    assert k_cache.dtype in (q.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs q dtype {q.dtype}"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                     groups: list[DecodeGroup] | None = None) -> torch.Tensor:
    if q.is_cuda:
        return decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                       k_scale, v_scale, out=out)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale,
                                v_scale, out=torch.empty_like(q))
    check_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    if torch.compiler.is_compiling():
        # A compiled CPU decode step (shared/engine/cpu_compile.py): the twin groups rows by the context
        # lengths' values, so it runs as one opaque op.
        res = torch.ops.kvmesh.decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                    sliding_window, k_scale, v_scale)
        if out is None:
            return res
        out.copy_(res)
        return out
    return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale,
                                v_scale, groups, out)


# The last step's decode groups, keyed by the identity and version of its block tables and context lengths:
# every layer of a compiled step calls the op below with the same two tensors (static buffers rewritten in
# place, so their version moves each step), and the grouping is computed by the first layer only, as the eager
# path does with AttentionMetadata.cpu_cache.
_last_groups: list = [None, None]


def _groups_for(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, sliding_window: int | None,
                dtype: torch.dtype) -> list[DecodeGroup]:
    if block_tables.is_inference() or context_lens.is_inference():  # no version counter: nothing to key on
        return decode_groups(block_tables, context_lens, block_size, sliding_window, dtype)
    key = (block_tables.data_ptr(), block_tables._version, tuple(block_tables.shape), context_lens.data_ptr(),
           context_lens._version, tuple(context_lens.shape), block_size, sliding_window, dtype)
    if _last_groups[0] != key:
        _last_groups[:] = [key, decode_groups(block_tables, context_lens, block_size, sliding_window, dtype)]
    return _last_groups[1]


@torch.library.custom_op("kvmesh::decode_attention_cpu", mutates_args=(), device_types="cpu")
def _decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, sliding_window: int | None, k_scale: float,
                          v_scale: float) -> torch.Tensor:
    groups = _groups_for(block_tables, context_lens, k_cache.shape[1], sliding_window, q.dtype)
    return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale,
                                v_scale, groups)


@_decode_attention_cpu.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale, v_scale) -> torch.Tensor:
    return torch.empty_like(q)
