"""bf16 linear layers on the C++ kernels' own AVX512-BF16 matmul (kernels/cpu/gemv_dpbf16.cpp), for CPU serving in
bf16 on CPUs with AVX512-BF16 and no AMX.

There oneDNN's bf16 matmul (PackedLinear) runs on torch's OpenMP team, which splits each matmul into fixed halves:
when another process takes one of the cores, every matmul waits for the half that lost its core, and a decode
step beside one busy process ran at 0.41x of its quiet speed on a 2-core Zen 5. The own kernel's loop is handed
out chunk by chunk to whichever thread is running, and on that CPU it is also faster than oneDNN at every step
size measured (SmolLM2's shapes, 1 to 128 rows: 2.7x at one row with the weights in cache, 2.1x at 8, 1.1x at
128). A model whose linear layers are all the kernels' own runs every loop on their threads
(shared/models/cpu_native.choose_kernel_threads).

On AMX CPUs oneDNN's tile instructions are another class of speed for prefill, and this project has not measured
them against the own kernel: PackedLinear stays. KVMESH_CPU_BF16_LINEAR=onednn|own overrides the choice.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

ENV = "KVMESH_CPU_BF16_LINEAR"


def dp_linear_choice() -> tuple[bool, str]:
    """(serve bf16 linears with DpLinear?, why)."""
    from kernels.cpu.extension import native_available
    from shared.models.cpu_dtype import native_bf16_flag

    pinned = os.environ.get(ENV, "").strip()
    if pinned not in ("", "own", "onednn"):
        raise ValueError(f"{ENV}={pinned!r}: choose own or onednn")
    if pinned == "onednn":
        return False, f"{ENV}=onednn"
    if not native_available():
        return False, "the C++ CPU kernels are off"
    from kernels.cpu.gemv_dpbf16 import built

    if not built():
        return False, "the C++ kernels were built without AVX512-BF16"
    if pinned == "own":
        return True, f"{ENV}=own"
    flag = native_bf16_flag()
    if flag != "avx512_bf16":
        return False, f"this CPU has {flag}: oneDNN's AMX matmul is kept" if flag else "no native bf16"
    return True, "AVX512-BF16 without AMX"


class DpLinear(nn.Module):
    """bf16 activations times a bf16 weight packed for vdpbf16ps (kernels/cpu/gemv_dpbf16.py), any number of rows;
    the twin (linear_dpbf16_ref) where the kernels are off."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        from kernels.cpu.extension import native_available
        from kernels.cpu.gemv_dpbf16 import pack_dpbf16

        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 2:
            raise ValueError(f"DpLinear takes a bf16 CPU weight with an even number of inputs, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_dpbf16(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.native = native_available()

    def dequantized(self) -> torch.Tensor:
        from kernels.cpu.gemv_dpbf16 import unpack_dpbf16

        return unpack_dpbf16(self.packed, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.gemv_dpbf16 import linear_dpbf16, linear_dpbf16_ref

        if x.dtype != torch.bfloat16:
            raise TypeError(f"DpLinear multiplies bf16 activations, got {x.dtype}")
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = (linear_dpbf16 if self.native else linear_dpbf16_ref)(x2, self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_take(linear: nn.Module) -> bool:
    w = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and w is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and w.shape[1] % 2 == 0)


@torch.no_grad()
def use_dp_linears(model: nn.Module) -> int:
    """Replace every plain bf16 nn.Linear of the model with a DpLinear in place; returns how many weights (elements)
    moved."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if can_take(child):
                setattr(parent, name, DpLinear(child.weight, child.bias))
                count += child.weight.numel()
    return count
