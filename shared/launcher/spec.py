"""What the mesh runs: one ServiceSpec per service kind, built from the `kvmesh up` options.

This is the single source of truth for service command lines. `kvmesh up` turns it into local
processes; compose/docker-compose.yml must run the same modules with the same flags and
environment (tests/test_launcher.py compares them).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Start order: the services others call first, the gateway (whose /health needs the rest) last.
SERVICES: tuple[str, ...] = ("kvstore", "tokenizer", "prefill", "decode", "gateway")
MODEL_SERVICES = frozenset({"tokenizer", "prefill", "decode", "gateway"})
ENGINE_SERVICES = frozenset({"prefill", "decode"})
DEFAULT_MODEL = Path(".models/demo")
DEFAULT_PORT = 8000
# Environment every service process gets, locally and in compose. Unbuffered output so the
# launcher's `[name]` prefixing and `docker logs` show lines as they are written.
SERVICE_ENV: Mapping[str, str] = {"PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class MeshOptions:
    """The `kvmesh up` options that shape what runs (not how the launcher behaves)."""

    model: str = str(DEFAULT_MODEL)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str | None = None  # None: the gateway's own default
    prefill: int = 1
    decode: int = 1
    tokenizer: int = 1
    kvstore: int = 1
    # None: decode's own default, except with no prefill workers, where remote prefill could
    # never be served, so every prompt is prefilled locally.
    remote_prefill_threshold: int | None = None
    log_level: str | None = None

    def __post_init__(self) -> None:
        for name in SERVICES:
            assert self.replicas(name) >= 0, f"--{name} must be >= 0"
        assert self.tokenizer >= 1 and self.decode >= 1, "the mesh needs at least one tokenizer and one decode worker"
        assert self.remote_prefill_threshold is None or self.remote_prefill_threshold >= 0

    def replicas(self, service: str) -> int:
        return 1 if service == "gateway" else int(getattr(self, service))


# Large enough that no prompt reaches it: "never prefill remotely".
NEVER_REMOTE = 2**31 - 1


@dataclass(frozen=True)
class ProcessSpec:
    """One OS process the supervisor runs: `name` is unique and prefixes its output."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the launcher's environment


@dataclass(frozen=True)
class ServiceSpec:
    """A service kind: the flags every replica shares (what compose runs too) and its count."""

    service: str
    replicas: int
    args: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def module(self) -> str:
        return f"services.{self.service}"

    def instance_name(self, index: int) -> str:
        return f"{self.service}-{index}"

    def instance_args(self, index: int) -> tuple[str, ...]:
        # Decode workers are addressed by id (per-worker subjects, router affinity) and every engine
        # worker labels its metrics with it, so each local replica gets a stable, readable one;
        # compose leaves it to the worker's default.
        if self.service in ("decode", "prefill"):
            return ("--worker-id", self.instance_name(index))
        return ()

    def processes(self, python: str, env: Mapping[str, str]) -> list[ProcessSpec]:
        return [
            ProcessSpec(
                name=self.instance_name(i),
                argv=(python, "-m", self.module, *self.args, *self.instance_args(i)),
                env={**self.env, **env},
            )
            for i in range(self.replicas)
        ]


def mesh_services(opts: MeshOptions) -> list[ServiceSpec]:
    return [ServiceSpec(name, opts.replicas(name), _service_args(name, opts), dict(SERVICE_ENV)) for name in SERVICES]


def _service_args(service: str, opts: MeshOptions) -> tuple[str, ...]:
    args: list[str] = []
    if service in MODEL_SERVICES:
        args += ["--model", opts.model]
    if service == "gateway":
        args += ["--host", opts.host, "--port", str(opts.port)]
    # The engines fold the model name into block hashes, so prefill, decode and the gateway must
    # agree on it or no prefix would ever be shared.
    if service in ENGINE_SERVICES | {"gateway"} and opts.served_model_name:
        args += ["--served-model-name", opts.served_model_name]
    if service in ENGINE_SERVICES and opts.kvstore == 0:
        args += ["--no-kvstore"]  # else every cache miss would ask a kvstore nobody serves
    if service == "decode":
        threshold = opts.remote_prefill_threshold
        if threshold is None and opts.prefill == 0:
            threshold = NEVER_REMOTE
        if threshold is not None:
            args += ["--remote-prefill-threshold", str(threshold)]
    if opts.log_level:
        args += ["--log-level", opts.log_level]
    return tuple(args)
