"""Weight-only quantization (`--quantization int8|int4`, shared/models/quant_linear.py) of a tensor-parallel rank's
shards, quantized so that each rank holds exactly its slice of what the single-device model would hold:

- column-parallel layers (q/k/v, gate/up) and the vocabulary-parallel head split output rows: int8's scale is per
  output row and int4's groups run along the input columns, so a rank's rows quantize to the whole layer's rows;
- row-parallel layers (o, down) split input columns: an int8 row's scale is the absolute maximum of the *whole*
  row, so the ranks agree on it first (one all-reduce MAX per layer, at load); int4 groups of 32 columns are the
  whole layer's groups when a rank's columns are a multiple of 32 (else the layer stays in the model dtype, as
  quantize_linear keeps such layers). The partial products are then summed by the all-reduce, the bias added once.

The results equal TP=1's quantized model up to where partial sums are rounded (the kernels output bfloat16)."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from shared.models.quant_linear import COMPUTE, HEAD_METHOD, INT4_GROUP, Int4Linear, Int8Linear, quantize_layers, quantize_linear
from shared.models.tp.group import TPGroup
from shared.models.tp.lm_head import ParallelLMHead
from shared.models.tp.row_linear import RowParallelLinear

log = logging.getLogger(__name__)


class _RowScaledInt8(Int8Linear):
    """Int8Linear of a rank's columns with the whole rows' scales (Int8Linear would take the slice's own maxima)."""

    def __init__(self, weight: torch.Tensor, row_absmax: torch.Tensor) -> None:
        nn.Module.__init__(self)
        w = weight.detach().float()
        scales = row_absmax.float().clamp(min=1e-12) / 127  # as Int8Linear, from the whole row's maximum
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(COMPUTE))
        self.register_buffer("bias", None)
        self.out_features, self.in_features = weight.shape


class RowParallelQuantLinear(nn.Module):
    """A row-parallel layer whose column slice is quantized: local quantized matmul, all-reduce, bias."""

    def __init__(self, layer: RowParallelLinear, method: str) -> None:
        super().__init__()
        self.tp: TPGroup = layer.tp
        w = layer.weight.detach()
        if method == "int8":
            absmax = w.float().abs().amax(dim=1).contiguous()
            dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=self.tp.group)
            self.local: nn.Module = _RowScaledInt8(w, absmax)
        else:
            self.local = Int4Linear(w, None)
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone())
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.local.dequantized()


class ParallelQuantLMHead(nn.Module):
    """The vocabulary-parallel head with this rank's rows int8 (the head is int8 under int4 too: HEAD_METHOD)."""

    def __init__(self, head: ParallelLMHead, method: str) -> None:
        super().__init__()
        self.tp, self.vocab_size = head.tp, head.vocab_size
        self.local = Int8Linear(head.weight, None) if method == "int8" else Int4Linear(head.weight, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(self.local(hidden))
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size]


def _quantize(layer: nn.Module, method: str) -> nn.Module:
    if isinstance(layer, RowParallelLinear):
        if method == "int4" and layer.in_features % INT4_GROUP:
            log.warning("int4: %d input features per rank are not a multiple of %d; layer kept in %s",
                        layer.in_features, INT4_GROUP, layer.weight.dtype)
            return layer
        return RowParallelQuantLinear(layer, method)
    return quantize_linear(layer, method)  # column-parallel: an nn.Linear over this rank's rows


@torch.no_grad()
def quantize_tp_model(model: nn.Module, method: str) -> int:
    """quantize_model for a tensor-parallel rank (every rank calls it: the int8 row scales are all-reduced);
    returns how many of this rank's weights are now quantized."""
    count = quantize_layers(model, lambda linear: _quantize(linear, method))
    if isinstance(model.lm_head, ParallelLMHead):
        count += model.lm_head.weight.numel()
        model.lm_head = ParallelQuantLMHead(model.lm_head, HEAD_METHOD[method])
    return count
