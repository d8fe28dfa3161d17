"""Batched multi-LoRA (Punica's BGMV): every row of a step may use a different adapter, or none.

For a projection y = x W^T, a LoRA adds (x A^T) B^T, A [r, in], B [out, r] (the adapter's scaling folded into B
at load). The adapters live in slots: A stacked [slots, R, in] and B [slots, out, R], R the largest rank served
(--max-lora-rank; a smaller adapter's rows and columns past its rank are zeros). Each row carries its slot index
(-1: the base model), so one launch serves a batch mixing adapters:

    shrink:  t[i]  = x[i] @ A[slot[i]]^T          [rows, R]
    expand:  y[i] += t[i] @ B[slot[i]]^T          (in place, into a column range of the fused projection's output)

The slot index is a device tensor read by the kernel, never a launch argument or a branch on the host, so a
CUDA graph captured over a step replays with other rows' adapters by rewriting that tensor (the graphs' static
inputs; shared/engine/lora_slots.py). One program per row (and per block of output columns for expand): a
row's dot products over R <= 64 are GEMVs, as in Punica, right for decode batches; prompt chunks go through
the same kernels row by row.

`lora_shrink_expand_ref` is the torch twin: the CPU path and the test oracle (grouping rows by adapter, so the
matmuls are as large as the batch allows).
"""
from __future__ import annotations

import torch

from kernels.triton_support import recording, tl, triton


def lora_shrink_expand_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           slots: torch.Tensor) -> None:
    """Torch twin: y[i] += (x[i] @ a[slots[i]].T) @ b[slots[i]].T for each row with slots[i] >= 0, in place.
    y [rows, out] (may be a column slice of a wider output), x [rows, in], a [S, R, in], b [S, out, R]."""
    check_lora(y, x, a, b, slots)
    used = torch.unique(slots).tolist()
    if len(used) == 1:  # every row the same adapter (or none): plain matmuls, no gather or scatter
        if used[0] >= 0:
            y.add_(((x @ a[used[0]].t()) @ b[used[0]].t()).to(y.dtype))
        return
    for s in used:
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        # index_put (y[rows] += ...): index_add_ into a column slice of the fused output is ~100x slower on CPU.
        y[rows] += ((x.index_select(0, rows) @ a[s].t()) @ b[s].t()).to(y.dtype)


def check_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    assert x.dim() == 2 and y.dim() == 2 and a.dim() == 3 and b.dim() == 3, "x, y [rows, n]; a, b [slots, ., .]"
    assert x.shape[0] == y.shape[0] == slots.shape[0], f"rows: x {x.shape[0]}, y {y.shape[0]}, slots {slots.shape[0]}"
    assert a.shape[2] == x.shape[1] and b.shape[1] == y.shape[1] and a.shape[1] == b.shape[2] and a.shape[0] == b.shape[0], \
        f"shapes: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}"


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, t_ptr, stride_x, stride_as, stride_ar, stride_t, K,
                            R: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program = one row: t[row, :R] = x[row, :K] @ A[slot]^T, accumulated in float32."""
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot < 0:
            return
        r = tl.arange(0, R)
        acc = tl.zeros([R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(x_ptr + row * stride_x + k, mask=km, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :], mask=km[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(t_ptr + row * stride_t + r, acc)

    @triton.jit
    def _lora_expand_kernel(t_ptr, b_ptr, slot_ptr, y_ptr, stride_t, stride_bs, stride_bn, stride_y, N,
                            R: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program = one row x BLOCK_N output columns: y[row, cols] += t[row, :R] @ B[slot, cols, :R]^T."""
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot < 0:
            return
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < N
        r = tl.arange(0, R)
        tv = tl.load(t_ptr + row * stride_t + r)
        bv = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + r[None, :], mask=cm[:, None],
                     other=0.0).to(tl.float32)
        delta = tl.sum(bv * tv[None, :], axis=1)
        yp = y_ptr + row * stride_y + cols
        yv = tl.load(yp, mask=cm, other=0.0)
        tl.store(yp, (yv.to(tl.float32) + delta).to(yv.dtype), mask=cm)


def lora_shrink_expand_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              slots: torch.Tensor, block_k: int = 128, block_n: int = 128) -> None:
    check_lora(y, x, a, b, slots)
    assert triton is not None, "triton is not installed"
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1, "rows contiguous"
    rows, k = x.shape
    rank = a.shape[1]
    assert rank & (rank - 1) == 0 and rank >= 1, f"slot rank {rank} must be a power of 2 (the slots are padded)"
    if not rows:
        return
    t = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(rows,)](x, a, slots, t, x.stride(0), a.stride(0), a.stride(1), t.stride(0), k,
                                 R=rank, BLOCK_K=block_k)
    n = y.shape[1]
    _lora_expand_kernel[(rows, triton.cdiv(n, block_n))](t, b, slots, y, t.stride(0), b.stride(0), b.stride(1),
                                                         y.stride(0), n, R=rank, BLOCK_N=block_n)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """y += each row's LoRA delta, in place (the Triton kernels on CUDA, the twin elsewhere)."""
    if y.is_cuda:
        lora_shrink_expand_triton(y, x, a, b, slots)
        return
    if recording():  # kernels/aot.py: the launches are recorded, the twin computes
        lora_shrink_expand_triton(y, x, a, b, slots)
    lora_shrink_expand_ref(y, x, a, b, slots)
