"""What every Triton kernel wrapper shares: the optional import, and one interpreter workaround."""
from __future__ import annotations

import os

import torch

try:  # Triton is optional: the CPU path (the torch twins) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def upcast_dot(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter (3.9) computes tl.dot of bfloat16 operands wrongly (errors of 1e10), while
    fp16 and fp32 are right; under the interpreter bf16 operands are upcast to fp32 first. On a GPU the
    kernels run bf16 dots natively."""
    # While launches are only recorded (kernels/aot.py), the variant is the GPU's: no upcast.
    return interpreting() and _recorder is None and dtype == torch.bfloat16


# Launch recording (kernels/aot.py): while a recorder is set, each dispatch on CPU also calls its Triton
# wrapper, whose launches the recorder intercepts instead of running, then computes with the torch twin.
# So the project's own wrappers, at real model shapes, say which kernel variants a GPU would compile.
_recorder = None


def recording() -> bool:
    return _recorder is not None


def set_recorder(recorder) -> None:
    global _recorder
    _recorder = recorder
