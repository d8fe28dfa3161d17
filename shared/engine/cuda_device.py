"""The CUDA device an engine computes on, made the current device of the thread that computes.

A tensor made with device="cuda:1" lands on GPU 1, but Triton launches, new CUDA streams and events, and
torch.cuda calls given no device use the calling thread's current device, which is GPU 0 until the thread sets
another. The current device is per thread, so an engine sets it once, on the thread that computes for the
engine's whole life (shared/engine/engine_thread.py), before anything touches the device."""
from __future__ import annotations

import torch


def device_index_to_set(device: str) -> int | None:
    """N for "cuda:N"; None for a bare "cuda" (it means the thread's current device, so there is nothing to set)
    and for any other device."""
    d = torch.device(device)
    return d.index if d.type == "cuda" else None


def use_device(device: str) -> None:
    """Make `device` this thread's current CUDA device (nothing off CUDA)."""
    index = device_index_to_set(device)
    if index is not None:
        torch.cuda.set_device(index)
