"""An engine on cuda:N makes GPU N the current device of the thread that computes for it: Triton launches, new
streams and torch.cuda calls without a device follow the thread's current device, not the tensors'."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.cuda_device import device_index_to_set, use_device
from shared.engine.engine_thread import EngineThread
from shared.engine.llm_engine import LLMEngine


@pytest.mark.parametrize(("device", "index"), [("cuda", None), ("cuda:0", 0), ("cuda:1", 1), ("cuda:3", 3),
                                                ("cpu", None), ("meta", None)])
def test_the_index_to_set_is_the_cuda_ordinal_if_one_is_named(device, index):
    assert device_index_to_set(device) == index


def test_off_cuda_nothing_is_set(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device("cpu")
    use_device("cuda")
    assert calls == []


class Stop(Exception):
    """Ends the engine's construction right after it set the device (this machine has no GPU to go on with)."""


def test_the_engine_sets_its_device_on_the_thread_that_builds_and_steps_it(monkeypatch):
    # The call-site check only: torch.cuda.set_device is recorded (there is no GPU here), nothing else is replaced.
    calls: list[tuple[int, str]] = []

    def set_device(index: int) -> None:
        calls.append((index, threading.current_thread().name))
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    config = EngineConfig(model="unused", device="cuda:1")

    async def start() -> None:
        await EngineThread(asyncio.get_running_loop(), lambda *_: None).start(lambda: LLMEngine(config))

    with pytest.raises(Stop):
        asyncio.run(start())
    assert calls == [(1, "engine")], "set once, before anything else, on the engine's own thread"
