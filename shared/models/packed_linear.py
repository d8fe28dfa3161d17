"""bf16 linear layers with oneDNN's pre-packed weights, for CPU serving.

`F.linear` in bfloat16 on a CPU hands oneDNN a plain row-major weight, which it re-blocks on every call. Packing
the weight once at load (`mkldnn._reorder_linear_weight`, the layout inductor's CPU freezing uses) and calling
`mkldnn._linear_pointwise` on it gives bit-identical results at about half the time in the memory-bound decode
(measured on this project's 2-core AVX512-BF16 CPU, SmolLM2's shapes: 576 x 3072 at batch 1 119 -> 52 us, the
576 x 49152 output head 4.0 -> 2.0 ms; batch 32 1.3-1.7x). Float32 is left alone: oneDNN's float32 sums in a
different order than MKL's, and float32 is the mode whose tokens the tests compare with transformers.

The packed weight is an opaque oneDNN tensor: the layer keeps nothing else, so the model holds no second copy
(a head tied to the embeddings gets its own packed copy; the embedding table stays plain for its lookups).
"""
from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

# torch.compile cannot trace an opaque oneDNN tensor (it has no storage to fake). A compiled decode step
# (shared/engine/cpu_compile.py) calls the packed matmul as one opaque op that finds its weight by a handle,
# a 0-dim tensor (a tensor, not an int, so one graph serves every layer without specialising on it). The
# registry holds no reference: the layer owns its weight.
_REGISTRY: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_NEXT = itertools.count()


@torch.library.custom_op("kvmesh::packed_linear", mutates_args=(), device_types="cpu")
def _packed_linear_op(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
                      ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _REGISTRY[int(handle)], bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, handle, bias, out_features) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def packing_available() -> bool:
    """oneDNN is built in and this CPU computes bf16 in it (AVX512-BF16 / AMX; torch's own check)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and mkldnn is not None
                and hasattr(mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs bf16 CPU weights, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only tunes the blocking; any number of rows works with the packed weight.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1),
                             persistent=False)
        key = next(_NEXT)
        _REGISTRY[key] = self.packed
        self.register_buffer("handle", torch.tensor(key, dtype=torch.int64), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"PackedLinear multiplies bf16 activations, got {x.dtype}")
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if torch.compiler.is_compiling():
            out = torch.ops.kvmesh.packed_linear(x2, self.handle, self.bias, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def pack_model(model: nn.Module) -> int:
    """Replace every plain bf16 nn.Linear of the model (quantized layers are not nn.Linear) with a PackedLinear
    in place; returns how many weights (elements) were packed."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += child.weight.numel()
    return count
