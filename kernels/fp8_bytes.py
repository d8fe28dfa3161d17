"""Index ops on a KV cache through its bytes when it holds one-byte floats (FP8).

Whether index_select, index_copy_ and index_put_ have a float8 kernel depends on the torch version and the device
(CPU has no index_copy_ for float8; CUDA gained float8 indexing later than the dtype itself). A one-byte float
viewed as uint8 has the same shape, strides and storage, and gathering or scattering bytes moves the same bits,
so every index op on a cache goes through this view and the question never arises."""
from __future__ import annotations

import torch


def indexable(t: torch.Tensor) -> torch.Tensor:
    """t itself, or for a one-byte float (float8_e4m3fn, float8_e5m2) its uint8 view over the same storage."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
