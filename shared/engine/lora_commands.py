"""Engine-thread commands that load and unload LoRA adapters while the engine serves (between steps)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.commands import Command
from shared.engine.llm_engine import LLMEngine


def _manager(engine: LLMEngine):  # noqa: ANN202 - the engine's LoRAManager
    if engine.lora is None:
        raise ValueError("this worker serves no LoRA adapters (start it with --enable-lora)")
    return engine.lora


@dataclass(frozen=True)
class LoadLoRA(Command[list[str]]):
    """Check, read and register an adapter (ValueError saying why not, nothing changed); the names held after."""

    name: str
    path: str

    def run(self, engine: LLMEngine) -> list[str]:
        _manager(engine).add(self.name, self.path)
        return engine.lora.names()


@dataclass(frozen=True)
class UnloadLoRA(Command[list[str]]):
    name: str

    def run(self, engine: LLMEngine) -> list[str]:
        _manager(engine).remove(self.name)
        return engine.lora.names()
