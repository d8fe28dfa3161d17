"""The dtype a model computes in on a CPU when `--dtype auto`: bfloat16 where the CPU computes it natively,
float32 elsewhere.

On x86 CPUs with AVX512-BF16 or AMX-BF16, torch's bf16 matmuls run on the CPU's own bf16 dot products and
move half the bytes: on this project's 2-core AVX512-BF16 machine SmolLM2-135M decodes 1.9x faster at batch 1
and 1.5x at batch 8 than in float32, with the same perplexity.
Without those instructions bf16 is emulated and slower than float32, so float32 stays the default there.
`KVMESH_CPU_DTYPE` (float32, bfloat16, float16) sets the CPU default for every worker a process starts
(the test suite pins float32, the dtype its exactness checks against transformers use); `--dtype` overrides
both.
"""
from __future__ import annotations

import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPU_DTYPES = ("float32", "bfloat16", "float16")
NO_NATIVE_BF16 = "this CPU has no native bf16 (no avx512_bf16 / amx_bf16)"


def native_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The CPU flag that makes bf16 native ('amx_bf16', 'avx512_bf16'), or None (also off Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    from kernels.cpu.extension import mask_flags  # KVMESH_CPU_ISA=avx2 hides AVX512-BF16 here too

    flags = mask_flags(set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                                 if line.startswith("flags")), [])))
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def default_cpu_dtype(cpuinfo: str | None = None) -> tuple[str, str]:
    """(dtype, why) for `--dtype auto` on a CPU."""
    pinned = os.environ.get("KVMESH_CPU_DTYPE", "").strip()
    if pinned and pinned != "auto":
        if pinned not in CPU_DTYPES:
            raise ValueError(f"KVMESH_CPU_DTYPE={pinned!r}: choose one of auto, {', '.join(CPU_DTYPES)}")
        return pinned, "KVMESH_CPU_DTYPE"
    flag = native_bf16_flag(cpuinfo)
    if flag:
        return "bfloat16", f"this CPU computes bf16 natively ({flag})"
    return "float32", NO_NATIVE_BF16


def float32_for_lack_of_bf16(dtype: str, device: str) -> bool:
    """`--dtype auto` on this CPU serves float32 only because the CPU has no native bf16 (not pinned): there a
    16-bit checkpoint's weights stay 16-bit (shared/models/quant_linear.py's WeightLinear)."""
    return dtype == "auto" and device == "cpu" and default_cpu_dtype()[1] == NO_NATIVE_BF16
