"""How an engine serves LoRA adapters (vLLM's flags): how many at once on the device, their largest rank, how many
kept in host memory, and those loaded at start."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.errors import ConfigError


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters in one step, each in a device slot (--max-loras)
    max_lora_rank: int = 16  # the slots' rank; a larger adapter is refused at load (--max-lora-rank)
    # Adapters whose weights stay in host memory; others are read from disk again when a request needs them
    # (--max-cpu-loras; None: max_loras).
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (name, path) loaded at start

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"--max-lora-rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def slot_rank(self) -> int:
        """The slots' rank: max_lora_rank rounded up to a power of 2 (the kernels' tile over the rank)."""
        r = 1
        while r < self.max_lora_rank:
            r *= 2
        return r


def parse_lora_modules(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    """vLLM's --lora-modules: `name=path` items, or JSON objects {"name", "path"} (base_model_name is accepted and
    checked against nothing: the adapter's tensor shapes are what must fit)."""
    import json

    out: list[tuple[str, str]] = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules {item!r}: a JSON item needs \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: expected name=path")
        if any(n == name for n, _ in out):
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return tuple(out)
