"""FP8 (e4m3) W8A8 linear layers (`--quantization fp8`): the weight in float8 with one float32 scale per output
row, the activations quantized per token at run time (or with a checkpoint's static per-tensor scale); the
product in kernels/fp8_gemm.py.

Either quantized here from a bf16/fp16/fp32 checkpoint (scale = max|row| / 448, round to nearest even), or loaded
as published: vLLM's `fp8` checkpoints and compressed-tensors `float-quantized` ones (a per-tensor weight scale is
repeated over the rows, so a fused q/k/v keeps each part's own; the parts' static input scales, which quantize the
same activations, become their maximum, as vLLM does).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels.fp8_gemm import FP8, FP8_MAX, fp8_gemm


@dataclass(frozen=True)
class Fp8Weights:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [N]
    input_scale: torch.Tensor | None = None  # float32 [1]: static activation scale; None: per token

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def columns(self, start: int, stop: int) -> Fp8Weights:
        """Output rows [start, stop) (named as the 4-bit layout's: the output features)."""
        return replace(self, weight=self.weight[start:stop].contiguous(),
                       weight_scale=self.weight_scale[start:stop].contiguous())

    def rows(self, start: int, stop: int) -> Fp8Weights:
        """Input features [start, stop)."""
        return replace(self, weight=self.weight[:, start:stop].contiguous())


def quantize_fp8_weight(weight: torch.Tensor) -> Fp8Weights:
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return Fp8Weights((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)


def from_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None) -> Fp8Weights:
    n = weight.shape[0]
    scale = weight_scale.float().reshape(-1)
    scale = scale.expand(n).contiguous() if scale.numel() == 1 else scale.contiguous()
    return Fp8Weights(weight.contiguous(), scale, None if input_scale is None else input_scale.float().reshape(1))


def fuse(parts: list[Fp8Weights], what: str) -> Fp8Weights:
    static = {p.input_scale is not None for p in parts}
    if len(static) > 1:
        raise ValueError(f"some fused parts of {what} have static input scales and some do not")
    if len(parts) == 1:
        return parts[0]
    inp = None if parts[0].input_scale is None else torch.stack([p.input_scale for p in parts]).amax().reshape(1)
    return Fp8Weights(torch.cat([p.weight for p in parts]), torch.cat([p.weight_scale for p in parts]), inp)


class Fp8Linear(nn.Module):
    def __init__(self, w: Fp8Weights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", w.weight)
        self.register_buffer("weight_scale", w.weight_scale)
        self.register_buffer("input_scale", w.input_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = w.weight.shape

    @classmethod
    def from_linear(cls, layer: nn.Module) -> Fp8Linear:
        return cls(quantize_fp8_weight(layer.weight), layer.bias)

    def weights(self) -> Fp8Weights:
        return Fp8Weights(self.weight, self.weight_scale, self.input_scale)

    def dequantized(self) -> torch.Tensor:
        return self.weights().dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.input_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations={'static' if self.input_scale is not None else 'per token'}")
