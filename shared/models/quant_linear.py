"""Weight-only quantized linear layers for CPU serving (`--quantization int8|int4`).

Decode on a CPU is memory-bound: every step streams every weight once. Keeping weights in 8 or 4 bits and
dequantizing inside the matmul reads 2x / 4x fewer bytes than bf16 (4x / 8x fewer than float32). The matmuls
are torch's own CPU weight-only kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`).
They accept float32 activations but are only fast in bfloat16 (measured on this project's 2-core CPU, one
576 x 1536 matmul at batch 1: int4 28 us in bf16, 5.3 ms in float32; int8 28 us vs 0.37 ms): the quantized
layers always multiply in bfloat16 (scales stored in bf16), casting a float32 model's activations in and out.

- int8: symmetric, one scale per output row: w = q * scale, q in [-127, 127].
- int4: asymmetric, one scale and minimum per group of 32 input columns (GGUF's Q4_1 layout, so a Q4_1
  checkpoint requantizes to the values it was stored with): w = q * scale + min, q in [0, 15]. torch's kernel
  computes (q - 8) * scale + zero, so zero = min + 8 * scale.

A layer whose input size is not a multiple of the group stays in the model dtype (logged); embeddings and
norms are never quantized. Each layer keeps what it needs to say what it computes (`dequantized()`), which is
the tests' oracle.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
COMPUTE = torch.bfloat16  # the dtype the quantized matmuls run in
INT4_GROUP = 32
_INNER_K_TILES = 2  # the packing torch's CPU int4 kernel reads


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(COMPUTE))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = weight.shape

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, group: int = INT4_GROUP,
                 blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """weight [out, in] is quantized by each group's min and max; or blocks = (q [out, in] in [0, 15], scale,
        lo [out, in / group]) are taken as they are (w = q * scale + lo: GGUF's Q4 blocks, Int4Linear.from_blocks)."""
        super().__init__()
        if blocks is None:
            n, k = weight.shape
            assert k % group == 0, f"in_features {k} is not a multiple of the int4 group {group}"
            w = weight.detach().float().view(n, k // group, group)
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)
            scale = (hi - lo) / 15
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, w = lo
            q = torch.round((w - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        else:
            q, scale, lo = blocks
            n, k = q.shape
            assert scale.shape == lo.shape == (n, k // group), f"{scale.shape} scales for a {n} x {k} weight"
            q, scale, lo = q.to(torch.int32).contiguous(), scale.float(), lo.float()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES))
        # [k / group, n, 2]: (scale, zero) with zero = lo + 8 * scale, in the activations' dtype.
        self.register_buffer("scales_zeros", torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1)
                             .contiguous().to(COMPUTE))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features, self.group = n, k, group

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bias: torch.Tensor | None,
                    group: int = INT4_GROUP) -> Int4Linear:
        """Already-quantized weights, w = q * scale + lo per group; scale and lo are rounded to bf16 (the kernel's
        dtype for bf16 activations)."""
        return cls(None, bias, group, blocks=(q, scale, lo))

    def dequantized(self) -> torch.Tensor:
        """What the layer multiplies by, as float32 [out, in]: unpacked by running the kernel on the identity."""
        eye = torch.eye(self.in_features, dtype=COMPUTE)
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_zeros)
        return cols.float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_linear(layer: nn.Linear, method: str) -> nn.Module:
    if method == "int8":
        return Int8Linear(layer.weight, layer.bias)
    if method == "int4":
        if layer.in_features % INT4_GROUP:
            log.warning("int4: %d input features are not a multiple of %d; layer kept in %s", layer.in_features,
                        INT4_GROUP, layer.weight.dtype)
            return layer
        return Int4Linear(layer.weight, layer.bias)
    raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATIONS)}")


# The projections of every decoder layer, then the output head (its own quantized copy when it is tied to the
# embeddings, which stay in the model dtype). Under int4 the head is int8, as llama.cpp's 4-bit mixes keep the
# output matrix at 6-8 bits: every logit goes through it, and on SmolLM2 an int4 head alone cost most of the
# int4 perplexity.
HEAD_METHOD = {"int8": "int8", "int4": "int8"}
_LAYER_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_layers(model: nn.Module, quantize: Callable[[nn.Module], nn.Module]) -> int:
    """Every decoder layer's linears replaced in place by quantize(linear) (which returns the linear itself to keep
    it); returns how many weights (elements) were replaced. The single-device and tensor-parallel walks share it."""
    count = 0
    for layer in model.layers:
        for parent_name, name in _LAYER_LINEARS:
            parent = getattr(layer, parent_name)
            old = getattr(parent, name)
            new = quantize(old)
            setattr(parent, name, new)
            count += old.weight.numel() if new is not old else 0
    return count


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the model's linear layers in place; returns how many weights (elements) are now quantized."""
    count = quantize_layers(model, lambda linear: quantize_linear(linear, method))
    new_head = quantize_linear(model.lm_head, HEAD_METHOD[method])
    if new_head is not model.lm_head:
        count += model.lm_head.weight.numel()
        model.lm_head = new_head
    return count


# ---- compact weights with float32 compute, for CPUs without native bf16 -------------------------------------------
# There torch's int4/int8 and bf16 matmuls are emulated and slow, so the model computes in float32; these layers
# keep the weights as stored (16-bit floats, or a GGUF's blocks) and widen them in registers inside the C++ kernels
# (kernels/cpu/gemv_bf16.cpp, gemv_gguf.cpp): a memory-bound decode step reads 2 (bf16), ~1.1 (Q8_0) or 0.75 (Q4)
# bytes a weight instead of 4. Without the C++ kernels they run their torch twins (correct, slow): the callers
# only build them when the kernels load.


def _cpu_kernels() -> bool:
    from kernels.cpu.extension import native_available

    return native_available()


def _interleaved_lanes(rows: int, act: int) -> int | None:
    """The group size GgufLinear interleaves rows by (kernels/cpu/gemv_gguf.py's pack_q4x / pack_q8x), or None: int8
    activations on the C++ kernels and a whole number of groups."""
    from kernels.cpu.gemv_gguf import ACT_Q8, q4x_lanes

    if act != ACT_Q8 or not _cpu_kernels():
        return None
    lanes = q4x_lanes()
    return lanes if rows % lanes == 0 else None


class WeightLinear(nn.Module):
    """float32 activations times a bfloat16 / float16 weight (kernels/cpu/gemv_bf16.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        from kernels.cpu.gemv_bf16 import W16_DTYPES

        assert dtype in W16_DTYPES, dtype
        self.register_buffer("weight16", weight.detach().to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.out_features, self.in_features = weight.shape
        self.native = _cpu_kernels()

    def dequantized(self) -> torch.Tensor:
        return self.weight16.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.gemv_bf16 import linear_w16, linear_w16_ref

        x2 = x.reshape(-1, self.in_features).contiguous()
        out = (linear_w16 if self.native else linear_w16_ref)(x2, self.weight16, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight16.dtype}"


class GgufLinear(nn.Module):
    """float32 (or bf16) activations times a weight in GGUF blocks (Q4_0/Q4_1/Q4_K, Q8_0 or Q6_K;
    kernels/cpu/gemv_gguf.py), with the activations rounded to int8 blocks (act ACT_Q8) or not (ACT_F32) in the
    block kernels' steps; the output in the activations' dtype."""

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, fmt: int, act: int, bias: torch.Tensor | None,
                 gguf_type: str) -> None:
        super().__init__()
        from kernels.cpu.gemv_gguf import Q4, Q4X, check

        self.register_buffer("qs", qs)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.fmt, self.act, self.gguf_type = fmt, act, gguf_type
        self.out_features = qs.shape[0]
        self.in_features = qs.shape[1] * 2 if fmt in (Q4, Q4X) else qs.shape[1]
        check(torch.empty(0, self.in_features), qs, scales, self.bias, fmt, act)
        self.native = _cpu_kernels()

    @classmethod
    def from_q4(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, act: int,
                gguf_type: str) -> GgufLinear:
        """codes [out, in] in 0..15, d / m [out, in / 32]: w = codes * d + m (Q4_0: m = -8 d). With int8
        activations and the C++ kernels the rows are interleaved in groups (Q4X, kernels/cpu/gemv_gguf.py's
        pack_q4x) where their number allows: one vector lane per row, no sums across lanes (at 1 row 1.4x faster
        on AVX-512 VNNI, 1.37x on AVX2, measured at Qwen3-0.6B's shapes; 1.05-1.6x at 2-8 rows)."""
        from kernels.cpu.gemv_gguf import Q4, Q4X, pack_q4, pack_q4x

        qs, scales = pack_q4(codes, d, m)
        lanes = _interleaved_lanes(codes.shape[0], act)
        if lanes:
            return cls(*pack_q4x(qs, scales, lanes), Q4X, act, bias, gguf_type)
        return cls(qs, scales, Q4, act, bias, gguf_type)

    @classmethod
    def from_q8_0(cls, weight: torch.Tensor, bias: torch.Tensor | None, act: int) -> tuple[GgufLinear, bool]:
        """The Q8_0 blocks back from their exact float32 dequantization (w = q d, the block's largest |q| is 127 as
        GGUF's quantizer writes it, so d = max |w| / 127 and q = w / d recover the file's values); (layer, whether
        they did: otherwise the weight is requantized to Q8_0 blocks, as llama.cpp would)."""
        from kernels.cpu.gemv_gguf import BLOCK, Q8_0, Q8X, pack_q8, pack_q8x

        n, k = weight.shape
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)
        d = w.abs().amax(dim=-1) / 127
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(w / safe[..., None]).clamp(-127, 127)
        exact = bool(torch.equal(q * d[..., None], w))
        qs, scales = pack_q8(q.to(torch.int8).view(n, k), d)
        lanes = _interleaved_lanes(n, act)  # rows interleaved, as from_q4's
        if lanes:
            return cls(*pack_q8x(qs, scales, lanes), Q8X, act, bias, "Q8_0"), exact
        return cls(qs, scales, Q8_0, act, bias, "Q8_0"), exact

    @classmethod
    def from_q8_16(cls, codes: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, act: int,
                   gguf_type: str) -> GgufLinear:
        """codes [out, in] int8, d [out, in / 16]: w = codes * d (GGUF Q6_K's codes minus 32 and scales)."""
        from kernels.cpu.gemv_gguf import Q8_16, pack_q8_16

        return cls(*pack_q8_16(codes, d), Q8_16, act, bias, gguf_type)

    def dequantized(self) -> torch.Tensor:
        from kernels.cpu.gemv_gguf import dequantize_ref

        return dequantize_ref(self.qs, self.scales, self.fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.gemv_gguf import linear_gguf, linear_gguf_ref

        # A bf16 model's activations (a CPU whose bf16 matmuls are the kernels' own) go in as they are: the kernel
        # reads bf16 and returns the activations' dtype.
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = (linear_gguf if self.native else linear_gguf_ref)(x2, self.qs, self.scales, self.bias, self.fmt, self.act)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.gguf_type}, "
                f"act={'int8' if self.act else 'float32'}")


@torch.no_grad()
def keep_weights_16bit(model: nn.Module, dtype: torch.dtype) -> int:
    """A float32 model's decoder linears and output head as WeightLinear in dtype (the checkpoint's own 16-bit
    dtype, so the conversion back is exact); returns how many weights (elements) are kept in 16 bits."""
    count = quantize_layers(model, lambda linear: WeightLinear(linear.weight, linear.bias, dtype)
                            if type(linear) is nn.Linear else linear)
    if type(model.lm_head) is nn.Linear:
        count += model.lm_head.weight.numel()
        model.lm_head = WeightLinear(model.lm_head.weight, model.lm_head.bias, dtype)
    return count
