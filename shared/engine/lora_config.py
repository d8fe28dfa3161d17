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


RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's variable; the flag is the same switch


def add_lora_arguments(parser, engine: bool = True, gateway: bool = False) -> None:  # noqa: ANN001 - argparse
    """vLLM's LoRA flags: the engine workers' (engine), the gateway's (gateway), or both (`kvmesh up`)."""
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (requests name one by model; implied by --lora-modules)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="PEFT adapters loaded at start: name=path, or JSON {\"name\": ..., \"path\": ...}; each "
                             "is listed in /v1/models with the base model as its parent")
    if engine:
        parser.add_argument("--max-loras", type=int, default=1,
                            help="adapters one step computes with (device slots; default 1)")
        parser.add_argument("--max-lora-rank", type=int, default=16,
                            help="largest adapter rank served; a larger one is refused at load (default 16)")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="adapters whose weights stay in host memory, least recently used dropped and read "
                                 "from disk again on demand (default: --max-loras)")
    if gateway:
        import os

        parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                            default=os.environ.get(RUNTIME_UPDATES_ENV, "").lower() in ("1", "true"),
                            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (env "
                                 f"{RUNTIME_UPDATES_ENV}=True)")


def lora_enabled(args) -> bool:  # noqa: ANN001 - argparse's namespace
    """--enable-lora, or adapters given with --lora-modules (which can only mean serving them)."""
    return bool(getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None))


def lora_service_args(args, engine: bool) -> list[str]:  # noqa: ANN001 - `kvmesh up`'s namespace
    """The LoRA flags `kvmesh up` passes on to an engine worker (engine) or the gateway; [] without --enable-lora.
    Adapter paths are made absolute (a worker may start elsewhere)."""
    import os

    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if not lora_enabled(args):
        return []
    out = ["--enable-lora"]
    if modules:
        out += ["--lora-modules", *(f"{n}={os.path.abspath(p)}" for n, p in modules)]
    if engine:
        out += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
        if args.max_cpu_loras is not None:
            out += ["--max-cpu-loras", str(args.max_cpu_loras)]
        LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)  # checked here, not in a crash loop
    elif args.allow_runtime_lora_updating:
        out.append("--allow-runtime-lora-updating")
    return out


def lora_config_from_args(args) -> LoRAConfig | None:  # noqa: ANN001 - argparse's namespace
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if not lora_enabled(args):
        return None
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                      modules=modules)
