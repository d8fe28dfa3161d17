"""4-bit weight-only linear layers from AWQ and GPTQ checkpoints, repacked at load into the one layout the kernel
reads (kernels/w4a16_gemm.py): 4-bit values packed along K, float16 scales and uint8 zeros per (group, column),
w = (q - zero) * scale.

The two formats, by their definitions:
- AWQ (AutoAWQ WQLinear_GEMM): qweight int32 [K, N / 8], eight columns per word, nibble i holding column
  AWQ_ORDER[i] of the eight; qzeros int32 [K / group, N / 8] packed the same way; scales [K / group, N];
  w = (q - z) * s.
- GPTQ (AutoGPTQ QuantLinear): qweight int32 [K / 8, N], nibble b of word r is row 8r + b; qzeros int32
  [groups, N / 8], nibble b of word c is column 8c + b, holding zero - 1 in the original (v1) format; scales
  [groups, N]; g_idx int32 [K], the group of each row (k // group, or a permutation's with desc_act);
  w = (q - (z + 1)) * s[g_idx].

desc_act rows are reordered at load so each group's rows are contiguous (the activations are permuted the same
way before the product: `perm`), as exllama and Marlin do; only when a tensor-parallel rank's share of the rows
does not fall in whole groups does the kernel read a per-row group index.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels.w4a16_gemm import w4a16_gemm
from kernels.w4a16_layout import BLOCK_K, pack_rows, unpack_rows, w4a16_dequantize

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of the eight is nibble AWQ_REVERSE_ORDER[j]


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C / 8] -> int32 [R, C]: column 8c + j is nibble order[j] of word c."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32, device=packed.device)
    vals = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
    return vals.reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class W4Weights:
    """One linear layer in the kernel's layout (rows in `perm` order when perm is set)."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # float16 [groups, N]
    zeros: torch.Tensor  # uint8 [groups, N]
    group: int
    g_idx: torch.Tensor | None = None  # int32 [K]: each row's group when the groups are not contiguous runs
    perm: torch.Tensor | None = None  # int64 [K]: the activation column of each row

    @property
    def k(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's column order."""
        w = w4a16_dequantize(self.qweight, self.scales, self.zeros, self.group, self.g_idx).t()
        if self.perm is None:
            return w.contiguous()
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def columns(self, start: int, stop: int) -> W4Weights:
        """Output columns [start, stop) (a column-parallel rank's share)."""
        return replace(self, qweight=self.qweight[:, start:stop].contiguous(),
                       scales=self.scales[:, start:stop].contiguous(), zeros=self.zeros[:, start:stop].contiguous())

    def rows(self, start: int, stop: int) -> W4Weights:
        """Input rows [start, stop) of the checkpoint's order (a row-parallel rank's share)."""
        if (stop - start) % BLOCK_K:
            raise ValueError(f"a share of {stop - start} input rows is not a multiple of {BLOCK_K} (the 4-bit "
                             "kernel's K tile)")
        if self.perm is None and self.g_idx is None and start % self.group == 0 and stop % self.group == 0:
            g0, g1 = start // self.group, stop // self.group
            return replace(self, qweight=self.qweight[start // 8 : stop // 8].contiguous(),
                           scales=self.scales[g0:g1].contiguous(), zeros=self.zeros[g0:g1].contiguous())
        dev = self.qweight.device
        perm = self.perm if self.perm is not None else torch.arange(self.k, device=dev)
        groups = self.g_idx.long() if self.g_idx is not None else torch.arange(self.k, device=dev) // self.group
        keep = (perm >= start) & (perm < stop)  # the rows stay sorted by group
        q = unpack_rows(self.qweight)[keep]
        return W4Weights(pack_rows(q), self.scales, self.zeros, self.group, groups[keep].to(torch.int32),
                         perm[keep] - start)


def _normal_form(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 g_idx: torch.Tensor | None) -> W4Weights:
    """q int [K, N] in the checkpoint's row order -> the layout: trivial g_idx dropped, act-order rows sorted."""
    k, dev = q.shape[0], q.device
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k, device=dev) // group):
        g_idx = None
    if g_idx is None:
        return W4Weights(pack_rows(q), scales.to(torch.float16), zeros.to(torch.uint8), group)
    perm = torch.argsort(g_idx.long(), stable=True)
    groups = g_idx.long()[perm]
    regular = torch.equal(groups, torch.arange(k, device=dev) // group)
    return W4Weights(pack_rows(q[perm]), scales.to(torch.float16), zeros.to(torch.uint8), group,
                     None if regular else groups.to(torch.int32), perm)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> W4Weights:
    q = unpack_cols(qweight, AWQ_REVERSE_ORDER)
    z = unpack_cols(qzeros, AWQ_REVERSE_ORDER)
    return _normal_form(q, scales, z, group, None)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group: int, zero_offset: int) -> W4Weights:
    q = unpack_rows(qweight)
    z = unpack_cols(qzeros) + zero_offset
    return _normal_form(q, scales, z, group, g_idx)


def fuse(parts: list[W4Weights], what: str) -> W4Weights:
    """Parts of one fused layer (q/k/v, gate/up) side by side along N; they read the same activations, so their
    row order (act-order permutation) must agree."""
    first = parts[0]
    for p in parts[1:]:
        same = (p.group == first.group and (p.perm is None) == (first.perm is None)
                and (p.perm is None or torch.equal(p.perm, first.perm))
                and (p.g_idx is None) == (first.g_idx is None) and (p.g_idx is None or torch.equal(p.g_idx, first.g_idx)))
        if not same:
            raise ValueError(f"the fused parts of {what} have different g_idx (act-order) row orders")
    if len(parts) == 1:
        return first
    return replace(first, qweight=torch.cat([p.qweight for p in parts], 1), scales=torch.cat([p.scales for p in parts], 1),
                   zeros=torch.cat([p.zeros for p in parts], 1))


class W4A16Linear(nn.Module):
    def __init__(self, w: W4Weights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scales", w.scales)
        self.register_buffer("zeros", w.zeros)
        self.register_buffer("g_idx", w.g_idx)
        self.register_buffer("perm", w.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.group, self.in_features, self.out_features = w.group, w.k, w.n

    def weights(self) -> W4Weights:
        return W4Weights(self.qweight, self.scales, self.zeros, self.group, self.g_idx, self.perm)

    def dequantized(self) -> torch.Tensor:
        return self.weights().dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        out = w4a16_gemm(x2, self.qweight, self.scales, self.zeros, self.group, self.g_idx)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"act_order={self.perm is not None}")
