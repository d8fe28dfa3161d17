"""What the mesh runs: one ServiceSpec per service kind, built from the `kvmesh up` options.

This is the single source of truth for service command lines. `kvmesh up` turns it into local
processes; compose/docker-compose.yml must run the same modules with the same flags and
environment (tests/test_launcher.py compares them).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from shared.gateway_flags import gateway_argv
from shared.subjects import NAMESPACE_ENV, model_namespace

# Start order: the services others call first, the gateway (whose /health needs the rest) last.
SERVICES: tuple[str, ...] = ("kvstore", "tokenizer", "prefill", "decode", "gateway")
MODEL_SERVICES = frozenset({"tokenizer", "prefill", "decode", "gateway"})
ENGINE_SERVICES = frozenset({"prefill", "decode"})
DEFAULT_MODEL = Path(".models/SmolLM2-135M-Instruct")
DEFAULT_PORT = 8000
# Environment every service process gets, locally and in compose. Unbuffered output so the
# launcher's `[name]` prefixing and `docker logs` show lines as they are written.
SERVICE_ENV: Mapping[str, str] = {"PYTHONUNBUFFERED": "1"}
# A pack of simulated workers (services/sim_pack.py) gets its members' bus credentials here, as a JSON object
# {worker id: {"user", "password", "inbox_prefix"}}: what NATS_USER/NATS_PASSWORD/NATS_INBOX_PREFIX are to a
# one-worker process.
PACK_IDENTITIES_ENV = "KVMESH_PACK_IDENTITIES"


@dataclass(frozen=True)
class ModelServing:
    """One model of the mesh and its own pools: tokenizer, prefill and decode workers (a model is served by
    its own workers only, on its own subjects: shared/subjects.py)."""

    model: str
    served_model_name: str | None = None  # None: the gateway's default (the directory's name)
    prefill: int = 0
    decode: int = 1
    tokenizer: int = 1
    max_model_len: int | None = None  # None: the workers' default (the checkpoint's); set by the GPU plan

    def __post_init__(self) -> None:
        assert self.prefill >= 0, "--prefill must be >= 0"
        assert self.tokenizer >= 1 and self.decode >= 0, "each model needs a tokenizer; --decode must be >= 0"
        assert self.max_model_len is None or self.max_model_len > 0, "--max-model-len must be positive"

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name


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
    remote_prefill_timeout_per_token: float | None = None  # None: decode's own default (by device)
    log_level: str | None = None
    # GPUs the engine workers are spread over (CUDA ordinals, as CUDA_VISIBLE_DEVICES names them);
    # empty: CPU, nothing is pinned. Workers sharing a GPU split gpu_memory_utilization (see placement()).
    devices: tuple[str, ...] = ()
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str | None = None  # None: the workers' default (auto)
    host_kv_bytes: int = 0  # each engine worker's host tier (0: none)
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: the workers' default (on for CUDA devices)
    max_model_len: int | None = None  # None: the workers' default (the checkpoint's); set by the GPU plan
    quantization: str | None = None  # engine workers' weight-only quantization on CPU (int8, int4)
    tool_call_parser: str | None = None  # the gateway's tool-call format (None: from the chat template)
    reasoning_parser: str | None = None  # the gateway's reasoning parser (None: from the chat template)
    structured_outputs_in_reasoning: bool = False  # the gateway's constraints cover <think> text too
    # "sim": the engine workers run the simulated engine (shared/engine/sim_engine.py): no model, a cost model's
    # step times. For scale tests and planner studies; `kvmesh up` says so loudly.
    engine: str = "real"
    sim_profile: str | None = None  # the simulated engine's cost-model profile (None: the workers' default)
    sim_speed: float = 1.0
    # Simulated engine workers per OS process (services/sim_pack.py): 80 of them fit in memory without 80
    # torch imports. 1: a process per worker, as for real workers.
    sim_workers_per_process: int = 1
    # The gateway's flags `kvmesh up` passes through (shared/gateway_flags.py, one field per flag's dest);
    # None/False: the gateway's default.
    routing: str | None = None
    max_inflight_requests: int | None = None
    max_queue_wait: float | None = None
    max_request_tokens: int | None = None
    stream_write_timeout: float | None = None
    trust_request_chat_template: bool = False
    scheduling_policy: str | None = None
    trusted_hosts: str | None = None
    threads: int | None = None  # each CPU engine worker's compute threads (None: its share of this host's cores)
    max_num_seqs: int | None = None  # engine workers' batch limit (None: the workers' default)
    # Tensor-parallel degree of each engine role's workers (each worker is that many processes: shared/engine/tp/).
    decode_tp: int = 1
    prefill_tp: int = 1
    # Decode workers' --speculative-config (normalised JSON; None: no speculation). Prefill workers sample one
    # token a request: nothing to speculate.
    speculative_config: str | None = None
    # Decode workers publish finished outputs to each other's suffix tables (needs suffix speculation).
    share_suffix_outputs: bool = False
    # The mesh's other models (`kvmesh up --model A --model B`): the fields above from `model` to `max_model_len`
    # are the first model's; every engine and gateway flag applies to all of them.
    more_models: tuple[ModelServing, ...] = ()
    # Other hosts join this mesh with their workers (`kvmesh up --write-join`): it may start with no decode
    # worker of its own.
    remote_workers: bool = False
    # "pooling": the model embeds or classifies; the mesh runs prefill workers in the pooling runner and no
    # decode worker (a pooling request is a prefill with no decode). convert / pooler_config: vLLM's flags.
    runner: str = "generate"
    convert: str | None = None
    pooler_config: str | None = None
    # LoRA flags passed on as they are (shared/engine/lora_config.py lora_service_args): engine workers', gateway's.
    lora_engine_args: tuple[str, ...] = ()
    lora_gateway_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in SERVICES:
            assert self.replicas(name) >= 0, f"--{name} must be >= 0"
        assert self.runner in ("generate", "pooling"), "--runner must be generate or pooling"
        # An adapter is trained for one base model: the mesh's LoRA adapters are those of its only model.
        assert not (self.lora_engine_args and self.more_models), "LoRA adapters need a mesh of one model (one --model)"
        if self.runner == "pooling":
            assert self.tokenizer >= 1 and self.prefill >= 1 and self.decode == 0, \
                "a pooling mesh needs at least one tokenizer and one prefill (pooling) worker, and no decode worker"
            assert not self.more_models, "--runner pooling serves one model"
        else:
            assert self.tokenizer >= 1 and (self.decode >= 1 or self.remote_workers), \
                "the mesh needs at least one tokenizer and one decode worker"
            # Decode workers on other hosts (a join file) serve only the first model.
            assert all(m.decode >= 1 for m in self.more_models), "each model needs at least one decode worker"
        assert self.remote_prefill_threshold is None or self.remote_prefill_threshold >= 0
        assert self.remote_prefill_timeout_per_token is None or self.remote_prefill_timeout_per_token > 0, \
            "--remote-prefill-timeout-per-token must be > 0"
        assert 0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]"
        assert self.kv_cache_dtype in (None, "auto", "fp8"), "--kv-cache-dtype must be auto or fp8"
        assert self.max_model_len is None or self.max_model_len > 0, "--max-model-len must be positive"
        assert self.max_num_seqs is None or self.max_num_seqs > 0, "--max-num-seqs must be positive"
        assert self.threads is None or self.threads > 0, "--threads must be positive"
        assert self.engine in ("real", "sim"), "--engine must be real or sim"
        assert self.sim_speed > 0, "--sim-speed must be > 0"
        assert self.sim_workers_per_process >= 1, "--sim-workers-per-process must be >= 1"
        assert self.sim_workers_per_process == 1 or self.engine == "sim", \
            "--sim-workers-per-process is for simulated workers (--engine sim) only"
        assert self.decode_tp >= 1 and self.prefill_tp >= 1, "--decode-tp and --prefill-tp must be >= 1"
        for role in ("decode", "prefill"):  # a worker's ranks each need their own GPU (NCCL: one rank per GPU)
            tp = self.tp(role)
            assert not (self.devices and self.replicas(role) and tp > len(self.devices)), (
                f"--{role}-tp {tp} needs {tp} GPUs, one per rank, but --devices gives {len(self.devices)} "
                f"({','.join(self.devices)}): add GPUs to --devices or lower --{role}-tp")
        assert not self.share_suffix_outputs or (
            self.speculative_config and json.loads(self.speculative_config).get("method") == "suffix"), \
            "--share-suffix-outputs needs suffix speculation (--speculative-config '{\"method\": \"suffix\"}')"
        assert not (self.engine == "sim" and max(self.decode_tp, self.prefill_tp) > 1), \
            "--engine sim runs no model: --decode-tp/--prefill-tp do not apply"
        if self.more_models:
            names = [m.name for m in self.models]
            dup = sorted({n for n in names if names.count(n) > 1})
            assert not dup, (f"two models would be served as {', '.join(dup)}: give each its own "
                             "--served-model-name")
            assert self.sim_workers_per_process == 1, "--sim-workers-per-process serves one model"

    @property
    def models(self) -> tuple[ModelServing, ...]:
        """Every model of the mesh, the first one (the top-level fields) first."""
        first = ModelServing(self.model, self.served_model_name, self.prefill, self.decode, self.tokenizer,
                             self.max_model_len)
        return (first, *self.more_models)

    def with_models(self, models: tuple[ModelServing, ...]) -> MeshOptions:
        """These options serving `models` (the first one's fields at the top level)."""
        m = models[0]
        return replace(self, model=m.model, served_model_name=m.served_model_name, prefill=m.prefill,
                       decode=m.decode, tokenizer=m.tokenizer, max_model_len=m.max_model_len,
                       more_models=tuple(models[1:]))

    def only(self, index: int) -> MeshOptions:
        """These options serving only the index-th model (what its own workers are started with)."""
        return self.with_models((self.models[index],))

    def total(self, role: str) -> int:
        """Workers of a role over every model."""
        return sum(getattr(m, role) for m in self.models)

    def replicas(self, service: str) -> int:
        return 1 if service == "gateway" else int(getattr(self, service))

    def tp(self, role: str) -> int:
        """Tensor-parallel degree of an engine role's workers (ranks, and GPUs, per worker)."""
        return self.decode_tp if role == "decode" else self.prefill_tp


# A decode worker holds every running request's KV for its whole life and batches far more requests
# than a prefill worker, which only keeps a prompt's KV until it is pushed; so on a shared GPU decode
# gets twice a prefill worker's share of the budget.
PLACEMENT_WEIGHT = {"decode": 2.0, "prefill": 1.0}


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]  # the worker's GPUs, rank r on devices[r] (one, without tensor parallelism)
    gpu_memory_utilization: float  # its share of each of those GPUs' total memory (the smallest any rank has)

    @property
    def device(self) -> str:
        """CUDA_VISIBLE_DEVICES for the worker process: its ranks see their GPUs as cuda:0, cuda:1, ... in order
        (shared/engine/tp/launch.rank_device), so each rank is pinned to its own."""
        return ",".join(self.devices)


def placement(opts: MeshOptions) -> dict[str, Placement]:
    """Engine worker instance name -> its GPUs and memory share; {} on CPU.

    Workers go round robin over the devices, decode workers first (so with fewer GPUs than workers the
    decode workers are spread widest); a tensor-parallel worker takes as many consecutive devices (wrapping
    round) as it has ranks. The ranks on one GPU split opts.gpu_memory_utilization by PLACEMENT_WEIGHT (a rank
    holds 1/tp of its worker's weights and KV, so each rank weighs what its role does), rounded down to 0.01 so
    the shares never add up to more than the total; a worker gets the smallest share any of its ranks has (one
    --gpu-memory-utilization for all its ranks)."""
    if not opts.devices:
        return {}
    names = [f"decode-{i}" for i in range(opts.total("decode"))] + [f"prefill-{i}" for i in range(opts.total("prefill"))]
    devices_of: dict[str, tuple[str, ...]] = {}
    cursor = 0
    for name in names:
        tp = opts.tp(name.split("-")[0])
        devices_of[name] = tuple(opts.devices[(cursor + r) % len(opts.devices)] for r in range(tp))
        cursor += tp
    weight_on: dict[str, float] = {}
    for name, devs in devices_of.items():
        for dev in devs:
            weight_on[dev] = weight_on.get(dev, 0.0) + PLACEMENT_WEIGHT[name.split("-")[0]]
    out = {}
    for name, devs in devices_of.items():
        share = min(opts.gpu_memory_utilization * PLACEMENT_WEIGHT[name.split("-")[0]] / weight_on[dev]
                    for dev in devs)
        out[name] = Placement(devs, int(share * 100) / 100)
    return out


# Large enough that no prompt reaches it: "never prefill remotely".
NEVER_REMOTE = 2**31 - 1


@dataclass(frozen=True)
class ProcessSpec:
    """One OS process the supervisor runs: `name` is unique and prefixes its output."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    # The bus identities (worker instance names) a pack of simulated workers runs; () for a one-service
    # process, whose identity is its name.
    members: tuple[str, ...] = ()


def service_module(name: str) -> str:
    """The module a service's process runs (`python -m services.<name>`): the launcher starts services as
    processes by name and imports none of them, so shared/ stays below services/ in the import graph."""
    return f"services.{name}"


@dataclass(frozen=True)
class ServiceSpec:
    """A service kind: the flags every replica shares (what compose runs too) and its count."""

    service: str
    replicas: int
    args: tuple[str, ...]
    env: Mapping[str, str]
    placement: Mapping[str, Placement] = field(default_factory=dict)  # instance name -> GPU (local runs only)
    pack: int = 1  # simulated engine workers per process (services/sim_pack.py)
    # Several models: the role's instances of the models before this one come first (instance names, hence
    # worker ids and bus identities, stay unique in the mesh: `decode-2` may be the second model's first).
    first_index: int = 0
    model_index: int = 0  # which of the mesh's models it serves (MeshOptions.models order)
    # A host that joined a mesh (shared/launcher/join.py) tags its instances `<service>-<tag>_<n>`: names
    # (bus users, worker ids) stay unique across hosts, and the role is still the part before the last "-".
    host_tag: str = ""

    @property
    def module(self) -> str:
        return service_module(self.service)

    def instance_name(self, index: int) -> str:
        name = f"{self.service}-{self.first_index + index}"
        return f"{self.service}-{self.host_tag}_{self.first_index + index}" if self.host_tag else name

    def instance_args(self, index: int) -> tuple[str, ...]:
        # Decode workers are addressed by id (per-worker subjects, router affinity) and every engine
        # worker labels its metrics with it, so each local replica gets a stable, readable one;
        # compose leaves it to the worker's default.
        args: tuple[str, ...] = ()
        if self.service in ("decode", "prefill"):
            args = ("--worker-id", self.instance_name(index))
        where = self.placement.get(f"{self.service}-{index}")  # placement() names this host's workers untagged
        if where is not None:
            args += ("--gpu-memory-utilization", f"{where.gpu_memory_utilization:g}")
        return args

    def instance_env(self, index: int) -> dict[str, str]:
        where = self.placement.get(f"{self.service}-{index}")
        return {"CUDA_VISIBLE_DEVICES": where.device} if where is not None else {}

    def processes(self, python: str, env: Mapping[str, str]) -> list[ProcessSpec]:
        if self.pack > 1 and self.service in ENGINE_SERVICES:
            packs = []
            for k, first in enumerate(range(0, self.replicas, self.pack)):
                names = tuple(self.instance_name(i) for i in range(first, min(self.replicas, first + self.pack)))
                packs.append(ProcessSpec(
                    name=f"{self.service}-pack-{k}",
                    argv=(python, "-m", service_module("sim_pack"), "--role", self.service, *self.args,
                          "--worker-ids", ",".join(names)),
                    env={**self.env, **env}, members=names))
            return packs
        return [
            ProcessSpec(
                name=self.instance_name(i),
                argv=(python, "-m", self.module, *self.args, *self.instance_args(i)),
                env={**self.env, **env, **self.instance_env(i)},
            )
            for i in range(self.replicas)
        ]


def mesh_services(opts: MeshOptions) -> list[ServiceSpec]:
    """Every service of the mesh; with several models, each model's tokenizer, prefill and decode specs (the
    later models' on their own subject namespace) in start order, one kvstore and one gateway for all."""
    where = placement(opts)
    specs: list[ServiceSpec] = []
    seen = dict.fromkeys(SERVICES, 0)
    for name in SERVICES:
        for k in range(len(opts.models) if name in MODEL_SERVICES - {"gateway"} else 1):
            own = opts.only(k) if name in MODEL_SERVICES - {"gateway"} else opts
            if opts.more_models and own is not opts:
                own = replace(own, served_model_name=opts.models[k].name)
            env = dict(SERVICE_ENV)
            if model_namespace(k):
                env[NAMESPACE_ENV] = model_namespace(k)
            specs.append(ServiceSpec(name, own.replicas(name), _service_args(name, own), env,
                                     {n: v for n, v in where.items() if n.startswith(name + "-")},
                                     opts.sim_workers_per_process, seen[name], k))
            seen[name] += own.replicas(name)
    return specs


def model_specs(specs: list[ServiceSpec], index: int) -> dict[str, ServiceSpec]:
    """The index-th model's tokenizer, prefill and decode specs by service (the planner scales them)."""
    return {s.service: s for s in specs if s.service in MODEL_SERVICES - {"gateway"} and s.model_index == index}


def _service_args(service: str, opts: MeshOptions) -> tuple[str, ...]:
    args: list[str] = []
    if service == "gateway" and opts.more_models:
        # Every model, with its name given explicitly: the engines fold it into block hashes, so each model's
        # workers and the gateway must agree on it.
        for m in opts.models:
            args += ["--model", m.model, "--served-model-name", m.name]
    elif service in MODEL_SERVICES:
        args += ["--model", opts.model]
    if service == "gateway":
        args += ["--host", opts.host, "--port", str(opts.port)]
        if opts.tool_call_parser:
            args += ["--tool-call-parser", opts.tool_call_parser]
        if opts.reasoning_parser:
            args += ["--reasoning-parser", opts.reasoning_parser]
        if opts.structured_outputs_in_reasoning:
            args.append("--structured-outputs-in-reasoning")
        args += gateway_argv(opts)
        args += opts.lora_gateway_args
    # The engines fold the model name into block hashes, so prefill, decode and the gateway must
    # agree on it or no prefix would ever be shared.
    if service in ENGINE_SERVICES | {"gateway"} and opts.served_model_name and not opts.more_models:
        args += ["--served-model-name", opts.served_model_name]
    if service in ENGINE_SERVICES and opts.kvstore == 0:
        args += ["--no-kvstore"]  # else every cache miss would ask a kvstore nobody serves
    if service == "decode":
        threshold = opts.remote_prefill_threshold
        if threshold is None and opts.prefill == 0:
            threshold = NEVER_REMOTE
        if threshold is not None:
            args += ["--remote-prefill-threshold", str(threshold)]
        if opts.remote_prefill_timeout_per_token is not None:
            args += ["--remote-prefill-timeout-per-token", f"{opts.remote_prefill_timeout_per_token:g}"]
        if opts.speculative_config:
            args += ["--speculative-config", opts.speculative_config]
        if opts.share_suffix_outputs:
            args += ["--share-suffix-outputs"]
    if service in ENGINE_SERVICES:
        if opts.kv_cache_dtype:
            args += ["--kv-cache-dtype", opts.kv_cache_dtype]
        if opts.host_kv_bytes:
            args += ["--host-kv-bytes", str(opts.host_kv_bytes)]
        if opts.enforce_eager:
            args += ["--enforce-eager"]
        if opts.async_scheduling is not None:
            args += ["--async-scheduling" if opts.async_scheduling else "--no-async-scheduling"]
        if opts.max_model_len:
            args += ["--max-model-len", str(opts.max_model_len)]
        if opts.max_num_seqs:
            args += ["--max-num-seqs", str(opts.max_num_seqs)]
        if opts.threads:
            args += ["--threads", str(opts.threads)]
        args += opts.lora_engine_args
        if opts.quantization:
            args += ["--quantization", opts.quantization]
        tp = opts.decode_tp if service == "decode" else opts.prefill_tp
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        if opts.engine == "sim":
            args += ["--engine", "sim", "--sim-speed", f"{opts.sim_speed:g}"]
            if opts.sim_profile:
                args += ["--sim-profile", opts.sim_profile]
    if opts.runner == "pooling" and service in ("prefill", "gateway"):
        args += ["--runner", "pooling"]
        if opts.convert:
            args += ["--convert", opts.convert]
        if opts.pooler_config:
            args += ["--pooler-config", opts.pooler_config]
    if opts.log_level:
        args += ["--log-level", opts.log_level]
    return tuple(args)
