"""Row-parallel linear: the weight's input columns are split; each rank multiplies its slice of the inputs (the
column-parallel layer before it left exactly that slice on it) and one all-reduce sums the partial outputs.
The bias is added once, after the sum."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.models.tp.group import TPGroup


class RowParallelLinear(nn.Module):
    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features_per_rank, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} per rank, out_features={self.out_features}, tp_size={self.tp.size}"
