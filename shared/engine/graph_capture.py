"""How the engine captures a CUDA graph (decode buckets, verify buckets, a draft model's decode buckets).

Capture runs in "thread_local" error mode. While a stream captures, CUDA refuses the calls that are unsafe
during a capture (a device sync, an event query, a fresh cudaMalloc); in the default "global" mode it refuses
them from every thread of the process. Under tensor parallelism NCCL's watchdog thread queries its events all
along, so a global capture can fail for work that never touches the captured stream. Thread-local still
refuses any unsafe call from the capturing thread itself (the engine thread: the only one that launches what a
graph records)."""
from __future__ import annotations

from typing import Any

CAPTURE_ERROR_MODE = "thread_local"


def capture_kwargs(pool: Any = None) -> dict[str, Any]:  # noqa: ANN401 - a CUDA graph pool handle
    """torch.cuda.graph's keyword arguments: the memory pool to share (None: a new one) and the error mode."""
    return {"pool": pool, "capture_error_mode": CAPTURE_ERROR_MODE}
