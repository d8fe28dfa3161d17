"""Structured-output token masks: logits of tokens the grammar forbids become -inf, in place.

The bitmask is xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit j of word w set means token
32 * w + j is allowed; a row of all -1 (every bit set) leaves its logits alone. Bits past the logits'
width (the vocabulary rounded up to 32) are ignored.
"""
from __future__ import annotations

import torch

from kernels.triton_support import recording, tl, triton


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Torch twin (the CPU path and the oracle)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


if triton is not None:

    @triton.jit
    def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab, stride_l, stride_m, BLOCK: tl.constexpr):
        """One program = one row x BLOCK tokens (BLOCK a multiple of 32)."""
        row = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        tok = start + tl.arange(0, BLOCK)
        ok = tok < vocab
        words = tl.load(mask_ptr + row * stride_m + tok // 32, mask=ok, other=-1)
        allowed = ((words >> (tok % 32)) & 1) != 0
        tl.store(logits_ptr + row * stride_l + tok, float("-inf"), mask=ok & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 1024) -> None:
    check_token_bitmask(logits, bitmask)
    assert triton is not None, "triton is not installed"
    rows, vocab = logits.shape
    _apply_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block)


def check_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    assert logits.dim() == 2 and bitmask.dim() == 2, "logits [rows, vocab] and bitmask [rows, words]"
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert bitmask.shape[0] == logits.shape[0], f"{bitmask.shape[0]} mask rows for {logits.shape[0]} logit rows"
    assert bitmask.shape[1] * 32 >= logits.shape[1], f"{bitmask.shape[1]} words cannot cover {logits.shape[1]} tokens"
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "rows must be contiguous"


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask logits in place; the bitmask is moved to the logits' device if it is not there yet."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda:
        return apply_token_bitmask_triton(logits, bitmask)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        apply_token_bitmask_triton(logits, bitmask)
    check_token_bitmask(logits, bitmask)
    apply_token_bitmask_ref(logits, bitmask)
