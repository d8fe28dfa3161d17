"""Column-parallel linear: the weight's output rows are split, each rank computes its slice of the outputs and
no collective is needed (the following row-parallel layer consumes the slices). Merged projections (q/k/v,
gate/up) are one such layer whose local rows are each part's own slice, laid out part after part: the loader
(shared/models/tp/shard_plan.py) puts rank r's q heads, then its k heads, then its v heads there."""
from __future__ import annotations

from torch import nn


class ColumnParallelLinear(nn.Linear):
    """nn.Linear over this rank's output rows: the forward is F.linear unchanged."""

    def __init__(self, in_features: int, out_features_per_rank: int, bias: bool, tp_size: int) -> None:
        super().__init__(in_features, out_features_per_rank, bias=bias)
        self.tp_size = tp_size

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp_size={self.tp_size} (output rows split)"
