"""Which GPUs `kvmesh up` can place engine workers on, found without importing torch."""
from __future__ import annotations

import os
import shutil
import subprocess


def visible_gpus() -> tuple[str, ...]:
    """CUDA ordinals as a child's CUDA_VISIBLE_DEVICES should name them: the launcher's own
    CUDA_VISIBLE_DEVICES entries if it has one, else the indices nvidia-smi lists, else none (CPU)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return tuple(d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def parse_devices(value: str | None) -> tuple[str, ...]:
    """--devices: None (all visible GPUs), "none" (CPU, nothing pinned) or a comma-separated list."""
    if value is None:
        return visible_gpus()
    if value.strip().lower() in ("none", "cpu", ""):
        return ()
    return tuple(d.strip() for d in value.split(",") if d.strip())
