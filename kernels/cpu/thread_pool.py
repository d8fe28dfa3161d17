"""Wrapper of thread_pool.cpp's ops: which threads run the C++ kernels' parallel loops, and their counters.

The kernels' own worker threads suit a step whose matmuls are these kernels too (16-bit and GGUF weights with
float32 compute, bf16 on the AVX512-BF16 kernel); a step whose matmuls are torch's (oneDNN bf16, int4/int8), or a
step through the Python path (shared/engine/model_runner.py), runs its loops on torch's OpenMP team
so the cores are not handed between two sets of threads between loops. KVMESH_CPU_POOL=omp|own overrides the
choice for the process.
"""
from __future__ import annotations

import torch

ENV = "KVMESH_CPU_POOL"


def use_torch_team(on: bool) -> bool:
    """Send the kernels' loops to torch's OpenMP team (on) or their own threads; returns where they go now (the
    environment's override wins). Call between steps."""
    return bool(torch.ops.kvmesh_cpu.pool_use_omp(on))


def stats() -> list[int]:
    """[workers started, jobs, chunks, chunks run by workers, 1 when loops go to torch's team]."""
    return list(torch.ops.kvmesh_cpu.pool_stats())
