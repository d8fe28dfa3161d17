"""Pinned host staging buffers, used in turn, each rewritten only after the copy that last read it has run.

A step's integers are written into a pinned host buffer and copied to the device asynchronously. The host
does not wait for that copy: the only sync of a step is the sampler's copy of the sampled ids, and a step
that samples nothing (a prompt's middle chunk) has none. Writing the same buffer for the next step could
then overwrite ids, positions and slots before the previous copy read them. As vLLM does, each step takes
the next of two buffers, and before writing one the host waits on the event recorded after the copy that
last read it (in steady state that copy finished long ago, so the wait costs nothing).
"""
from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class Event(Protocol):
    def synchronize(self) -> None: ...


class CopyStream(Protocol):
    """Where the host-to-device copies go: enqueue a copy; record an event after everything enqueued so far."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Event: ...


class CudaCopies:
    """The current CUDA stream (the one the model's kernels run on, so they see the copied inputs)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record()
        return event


class StagingRing(Generic[T]):
    """`buffers` used in turn: `acquire()` returns the next one once its last copy has run; after enqueuing
    the copies that read it, `sent()` records the event that `acquire` will wait on next time round."""

    def __init__(self, buffers: list[T], stream: CopyStream | None) -> None:
        self.buffers = buffers
        self.stream = stream
        self.events: list[Event | None] = [None] * len(buffers)
        self.at = len(buffers) - 1

    def acquire(self) -> T:
        self.at = (self.at + 1) % len(self.buffers)
        event = self.events[self.at]
        if event is not None:
            event.synchronize()
            self.events[self.at] = None
        return self.buffers[self.at]

    def sent(self) -> None:
        if self.stream is not None:
            self.events[self.at] = self.stream.record()


def copy_stream_for(device: str) -> CopyStream | None:
    """None on CPU: host and device memory are one, there is nothing asynchronous to order."""
    return CudaCopies() if device.startswith("cuda") else None
