"""`kvmesh up`: the whole mesh as local processes, one per service replica.

Starts a nats-server (unless NATS_URL is given), every service, waits for the gateway's /health
and prints the URL. One Ctrl-C (or SIGTERM): SIGTERM to every service, up to the grace period
for them to drain, SIGKILL for stragglers, then the nats-server goes.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from shared.engine.errors import EXIT_CONFIG, ConfigError
from shared.engine.lora_config import add_lora_arguments, lora_service_args
from shared.launcher.gpu_plan import (WORKER_DEFAULTS, PlanError, gpu_memory_from_nvidia_smi, parse_gpu_memory,
                                     plan_mesh, worker_needs)
from shared.launcher.cpu_layout import cpu_default_layout
from shared.launcher.gpus import parse_devices
from shared.launcher.local_nats import LocalNats, identity_passwords
from shared.launcher.readiness import wait_healthy
from shared.launcher.secrets_dir import secrets_dir
from shared.engine.sim_profile import ProfileError
from shared.launcher.planned import start_planner
from shared.launcher.process_spec import (DEFAULT_MODEL, DEFAULT_PORT, ENGINE_SERVICES, PACK_IDENTITIES_ENV, SERVICES,
                                  MeshOptions, ProcessSpec, mesh_services)
from shared.planner.config import PlannerConfig, PlannerConfigError, RoleLimits
from shared.planner.scaler import SupervisorScaler
from shared.launcher.supervisor import Emit, Supervisor, describe_exit, print_line
from shared.models.model_config import load_model_config
from shared.service_runner import DEFAULT_GRACE_S
from shared.spec_config import SpeculativeConfig

READY = "kvmesh is up at"  # tests wait for this line
# A service drains for up to its grace period, then its NATS connection for up to 5 s more
# (shared/service_runner.py); SIGKILL only after that.
DRAIN_MARGIN_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MeshOptions()
    parser.add_argument("--model", default=None, help=f"HF model directory or .gguf file (default {DEFAULT_MODEL}, written as the demo model if missing)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: the gateway's choice)")
    parser.add_argument("--host", default=d.host, help=f"gateway bind address (default {d.host})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gateway port (default {DEFAULT_PORT})")
    parser.add_argument("--prefill", type=int, default=None,
                        help=f"prefill workers (default {d.prefill} on GPUs, or 0 when the GPU plan needs it; 0 on CPU, where "
                             "a prefill worker shares decode's cores; 0: all prefill local)")
    parser.add_argument("--decode", type=int, default=None, help=f"decode workers (default {d.decode})")
    parser.add_argument("--tokenizer", type=int, default=d.tokenizer, help=f"tokenizer workers (default {d.tokenizer})")
    parser.add_argument("--kvstore", type=int, default=d.kvstore, help=f"kvstore replicas (default {d.kvstore}; 0: none)")
    parser.add_argument("--remote-prefill-threshold", type=int, default=None, metavar="TOKENS",
                        help="uncached prompt tokens from which decode prefills remotely (0: always; default: decode's own)")
    parser.add_argument("--grace", type=float, default=None,
                        help=f"seconds each service may drain on Ctrl-C (default: the services' own, {DEFAULT_GRACE_S:g})")
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help="GPUs for the engine workers, e.g. 0,1 (round robin, decode first; default: every "
                             "visible GPU; 'none': CPU). Workers on one GPU split --gpu-memory-utilization")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help=f"share of each GPU's total memory for all the workers on it (default {d.gpu_memory_utilization})")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"], help="engine workers' KV cache dtype")
    parser.add_argument("--host-kv-bytes", type=int, default=0, metavar="BYTES",
                        help="each engine worker keeps KV blocks evicted from its device pool in this much host "
                             "memory (default 0: none; on GPUs a few GiB saves recomputing evicted prefixes)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine workers run without CUDA graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="engine workers schedule the next step while the current one computes (default: on "
                             "for GPUs, off on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="engine workers' context length (default: the model's, lowered by the GPU plan if it "
                             "cannot fit)")
    parser.add_argument("--gpu-memory", action="append", default=[], metavar="[DEVICE=]SIZE",
                        help="plan for GPUs of this size instead of asking nvidia-smi, e.g. 80GiB or 1=24GB "
                             "(repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the GPU plan and the processes that would start, then exit")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the gateway's tool-call format for tool_choice auto (hermes, llama3_json, mistral, "
                             "qwen3_coder, pythonic; default: from the chat template)")
    parser.add_argument("--reasoning-parser", default=None,
                        help="the gateway's reasoning parser (qwen3, deepseek_r1; default: from the chat template)")
    parser.add_argument("--structured-outputs-in-reasoning", action="store_true",
                        help="the gateway applies structured outputs and forced tool calls to <think> text too "
                             "(default: they start after it)")
    parser.add_argument("--quantization", default=None,
                        choices=["auto", "none", "gguf", "gguf-hybrid", "int8", "int4"],
                        help="engine workers on CPU keep their linear layers' weights in int8 (per row) or int4 "
                             "(groups of 32): 2-4x fewer bytes a decode step than bf16; gguf: a GGUF's Q4_0/Q4_1/"
                             "Q8_0 weights as stored (gguf-hybrid: plus a bf16 copy for steps of more than 4 rows); "
                             "none: dequantized (default, auto: gguf-hybrid for a GGUF model served in bf16 on CPU)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="every engine worker split across this many ranks (processes; gloo on CPU)")
    parser.add_argument("--decode-tp", type=int, default=None, help="decode workers' tensor-parallel size "
                        "(default --tensor-parallel-size)")
    parser.add_argument("--prefill-tp", type=int, default=None, help="prefill workers' tensor-parallel size "
                        "(default --tensor-parallel-size); KV moves between different degrees whole, by heads")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='decode workers decode speculatively: vLLM\'s JSON, e.g. {"method": "ngram", '
                             '"num_speculative_tokens": 4}, {"method": "suffix"} or {"method": "draft_model", "model": DIR}')
    parser.add_argument("--share-suffix-outputs", action="store_true",
                        help="suffix speculation: decode workers learn each other's finished outputs (measured: "
                             "1-5%% fewer decode steps; kvmesh bench spec-shared)")
    parser.add_argument("--kvstore-disk-dir", default=".kvmesh/kvstore",
                        help="the kvstore's persistent disk tier, kept across runs ('none': memory only)")
    parser.add_argument("--nats-tls", action="store_true",
                        help="the local nats-server requires TLS (a throwaway CA and certificate for this run)")
    parser.add_argument("--nats-servers", type=int, default=1, metavar="N",
                        help="run the local NATS as a cluster of N servers joined by routes (default 1); services "
                             "are spread over them and fail over to another when theirs goes away")
    parser.add_argument("--insecure-bus", action="store_true",
                        help="run the local nats-server open (no users, no subject permissions); by default "
                             "every service connects as its role with a generated password")
    parser.add_argument("--engine", choices=["real", "sim"], default="real",
                        help="sim: SIMULATED engine workers for scale tests and planner studies: the real scheduler, "
                             "KV bookkeeping and bus protocol, no model (step times from --sim-profile, synthetic "
                             "tokens, placeholder KV); no GPU plan")
    parser.add_argument("--sim-profile", default=None, metavar="PATH",
                        help="cost-model profile of the simulated workers (default: the shipped H100 Llama-3.1-8B one)")
    parser.add_argument("--sim-speed", type=float, default=1.0,
                        help="the simulated workers run this many times faster than their profile (default 1)")
    parser.add_argument("--sim-workers-per-process", type=int, default=1, metavar="K",
                        help="--engine sim: run up to K simulated workers of a role in one process, each with its own "
                             "bus identity (a 64+16 worker mesh on a small machine; not with --planner)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="engine workers' batch limit (default: theirs, 128); the load planner reads it too")
    parser.add_argument("--routing", choices=["kv", "round-robin"], default=None,
                        help="the gateway's routing: kv (default, KV-aware) or round-robin (a baseline)")
    parser.add_argument("--max-inflight-requests", type=int, default=None, metavar="N",
                        help="the gateway serves at most N generation requests at once; past it 429 with Retry-After "
                             "(default: the gateway's, 1024; 0: no bound)")
    parser.add_argument("--planner", choices=["load", "sla"], default=None,
                        help="scale prefill and decode workers while serving: load (queue and KV-usage thresholds) "
                             "or sla (predicted TTFT/ITL against --ttft-slo-ms/--itl-slo-ms); --prefill/--decode "
                             "are the starting counts")
    for role, lo, hi in (("prefill", 0, 4), ("decode", 1, 4)):
        parser.add_argument(f"--{role}-min", type=int, default=lo, help=f"planner: fewest {role} workers (default {lo})")
        parser.add_argument(f"--{role}-max", type=int, default=hi, help=f"planner: most {role} workers (default {hi})")
    parser.add_argument("--planner-budget", type=int, default=0, metavar="N",
                        help="planner: most engine workers at once (default: the GPU plan's worker count on GPUs, "
                             "else the sum of the maxima)")
    parser.add_argument("--planner-interval", type=float, default=10.0, metavar="S",
                        help="planner: seconds between decisions (default 10)")
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="planner sla: time-to-first-token target")
    parser.add_argument("--itl-slo-ms", type=float, default=None, help="planner sla: inter-token latency target")
    parser.add_argument("--planner-profile", default=None, metavar="PATH",
                        help="planner sla: the cost-model profile it predicts from (default: --sim-profile's, or "
                             "the shipped H100 one)")
    parser.add_argument("--planner-port", type=int, default=0,
                        help="planner: port of its /metrics and /decisions endpoint (default: any free port)")
    parser.add_argument("--drain-grace", type=float, default=5.0, metavar="S",
                        help="planner: seconds a removed worker may finish its requests before the rest move to "
                             "other workers (default 5)")
    add_lora_arguments(parser, engine=True, gateway=True)
    parser.add_argument("--log-level", default=None, help="log level for every service")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health (default 300)")


def _speculative_config(text: str | None) -> str | None:
    """Checked here (a bad config is one error at start, not a crash loop of every decode worker); the workers
    get it back as normalised JSON."""
    spec = SpeculativeConfig.parse(text)
    if spec is not None and spec.model is not None and Path(spec.model).exists():
        spec = replace(spec, model=str(Path(spec.model).resolve()))  # the workers may start elsewhere
    return None if spec is None else spec.to_json()


def run(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else DEFAULT_MODEL
    try:
        opts = MeshOptions(
            model=str(model), host=args.host, port=args.port, served_model_name=args.served_model_name,
            prefill=MeshOptions.prefill if args.prefill is None else args.prefill,
            decode=MeshOptions.decode if args.decode is None else args.decode,
            tokenizer=args.tokenizer, kvstore=args.kvstore, max_model_len=args.max_model_len,
            remote_prefill_threshold=args.remote_prefill_threshold, log_level=args.log_level,
            devices=parse_devices(args.devices), gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, host_kv_bytes=args.host_kv_bytes,
            async_scheduling=args.async_scheduling,
            quantization=args.quantization, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
            engine=args.engine, speculative_config=_speculative_config(args.speculative_config),
            share_suffix_outputs=args.share_suffix_outputs,
            sim_profile=str(Path(args.sim_profile).resolve()) if args.sim_profile else None, sim_speed=args.sim_speed,
            sim_workers_per_process=args.sim_workers_per_process, routing=args.routing,
            max_inflight_requests=args.max_inflight_requests,
            max_num_seqs=args.max_num_seqs,
            decode_tp=args.decode_tp or args.tensor_parallel_size,
            prefill_tp=args.prefill_tp or args.tensor_parallel_size,
            lora_engine_args=tuple(lora_service_args(args, engine=True)),
            lora_gateway_args=tuple(lora_service_args(args, engine=False)),
        )
    except (AssertionError, ConfigError) as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 2
    if opts.engine == "sim":
        from shared.engine.sim_profile import DEFAULT_PROFILE, load_profile

        try:  # read here too: a bad profile is an error at start, not a crash loop of every worker
            profile = load_profile(opts.sim_profile or DEFAULT_PROFILE)
        except ProfileError as e:
            print(f"kvmesh up: --sim-profile: {e}", file=sys.stderr)
            return 2
        print(f"[kvmesh] SIMULATED engine workers (--engine sim): no model runs; step times from the profile "
              f"{profile.name!r} (x{opts.sim_speed:g}), synthetic tokens, placeholder KV. For scale tests and "
              f"planner studies only: the outputs are not a model's.", flush=True)
        opts = replace(opts, devices=(), quantization=None)  # nothing to place on a GPU
    if opts.quantization not in (None, "auto", "none") and opts.devices:
        print(f"kvmesh up: --quantization {opts.quantization} is weight-only quantization for CPU workers; the "
              f"workers here go on GPUs {','.join(opts.devices)} (add --devices none to serve on the CPU)",
              file=sys.stderr)
        return 2
    missing = missing_services()
    if missing:
        print("kvmesh up: cannot start the mesh, service module(s) missing: "
              + ", ".join(f"services.{m} (services/{m}/__main__.py)" for m in missing), file=sys.stderr)
        return 2
    if not args.dry_run and not _port_free(opts.host, opts.port):
        # Else the gateway would crash-loop, and whatever holds the port might even answer /health.
        print(f"kvmesh up: {opts.host}:{opts.port} is in use; pick another port with --port", file=sys.stderr)
        return 2
    if args.nats_servers < 1:
        print("kvmesh up: --nats-servers must be at least 1", file=sys.stderr)
        return 2
    planner = None
    if args.planner and opts.sim_workers_per_process > 1:
        # The planner starts and drains workers one process each; a packed worker cannot be drained alone.
        print("kvmesh up: --sim-workers-per-process does not combine with --planner (it scales one process per "
              "worker)", file=sys.stderr)
        return 2
    if args.planner:
        try:
            planner = planner_config(args, opts)
        except (PlannerConfigError, ProfileError) as e:
            print(f"kvmesh up: {e}", file=sys.stderr)
            return 2
        lim = planner.limits
        opts = replace(opts, prefill=min(lim["prefill"].max, max(lim["prefill"].min, opts.prefill)),
                       decode=min(lim["decode"].max, max(lim["decode"].min, opts.decode)))
        if opts.prefill == 0 and opts.remote_prefill_threshold is None:
            # Prefill workers may come later: decode must keep asking for them (it prefills locally meanwhile).
            opts = replace(opts, remote_prefill_threshold=planner.remote_prefill_threshold)
    if not (model / "config.json").is_file():
        if args.model is not None:
            print(f"kvmesh up: {model} is not a model directory (no config.json)", file=sys.stderr)
            return 2
        from shared.models.demo import build_real_demo_model
        from shared.models.smollm2 import SmolLM2Unavailable

        print(f"[kvmesh] writing the demo model (SmolLM2-135M-Instruct) in {model}", flush=True)
        try:
            build_real_demo_model(model)
        except SmolLM2Unavailable as e:
            print(f"kvmesh up: {e}; then `kvmesh up --model DIR`", file=sys.stderr)
            return 2
    try:
        opts = plan_gpus(opts, args.gpu_memory, layout_given=args.prefill is not None or args.decode is not None)
    except PlanError as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return EXIT_CONFIG
    # A remote-prefill threshold asks for prefill workers as --prefill does (without them it would only time out).
    opts, note = cpu_default_layout(opts, args.prefill is not None or args.remote_prefill_threshold is not None,
                                    planned=planner is not None)
    if note:
        print(note, flush=True)
    if args.dry_run:
        for spec in mesh_services(opts):
            for proc in spec.processes(sys.executable, {}):
                print(f"{proc.name}: {' '.join(proc.argv[1:])}" + "".join(f" {k}={v}" for k, v in proc.env.items()
                                                                        if k == "CUDA_VISIBLE_DEVICES"))
        return 0
    disk = None if args.kvstore_disk_dir.lower() == "none" else str(Path(args.kvstore_disk_dir).resolve())
    if planner is not None and not planner.budget and opts.devices:
        planner = replace(planner, budget=opts.prefill + opts.decode)  # the GPU plan's capacity
    return asyncio.run(up(opts, grace=args.grace, startup_timeout=args.startup_timeout, secure_bus=not args.insecure_bus,
                          kvstore_disk_dir=disk, nats_tls=args.nats_tls, nats_servers=args.nats_servers,
                          planner=planner, planner_port=args.planner_port, drain_grace=args.drain_grace))


def planner_config(args: argparse.Namespace, opts: MeshOptions) -> PlannerConfig:
    """The planner's settings from the flags: PlannerConfigError / ProfileError naming what is wrong."""
    profile = None
    if args.planner == "sla":
        from shared.engine.sim_profile import DEFAULT_PROFILE, load_profile

        profile = args.planner_profile or opts.sim_profile or str(DEFAULT_PROFILE)
        load_profile(profile)  # a profile that does not parse is an error now, not at the first decision
    ms = lambda v: None if v is None else v / 1000  # noqa: E731
    return PlannerConfig(
        mode=args.planner, limits={r: RoleLimits(getattr(args, f"{r}_min"), getattr(args, f"{r}_max"))
                                   for r in ("prefill", "decode")},
        budget=args.planner_budget, interval_s=args.planner_interval, ttft_slo_s=ms(args.ttft_slo_ms),
        itl_slo_s=ms(args.itl_slo_ms), profile=profile, speed=opts.sim_speed if opts.engine == "sim" else 1.0,
        remote_prefill_threshold=opts.remote_prefill_threshold if opts.remote_prefill_threshold is not None else 512,
        max_num_seqs=opts.max_num_seqs or WORKER_DEFAULTS.max_num_seqs)


def plan_gpus(opts: MeshOptions, gpu_memory: list[str], layout_given: bool) -> MeshOptions:
    """The GPU plan (shared/launcher/gpu_plan.py), printed; the options to start with. PlanError if nothing fits."""
    if not opts.devices:
        print("[kvmesh] engine workers on CPU: no GPU plan", flush=True)
        return opts
    sizes = parse_gpu_memory(gpu_memory, opts.devices) or gpu_memory_from_nvidia_smi(opts.devices)
    cfg = load_model_config(opts.model)
    d = WORKER_DEFAULTS
    needs = worker_needs(cfg, "auto", opts.kv_cache_dtype or "auto", d.max_num_batched_tokens,
                         opts.max_num_seqs or d.max_num_seqs)
    plan = plan_mesh(opts, sizes, needs, cfg.max_position_embeddings, d.block_size, layout_given)
    print(plan.table(), flush=True)
    keep_len = plan.max_model_len == (opts.max_model_len or cfg.max_position_embeddings)
    return replace(opts, prefill=plan.prefill, decode=plan.decode,
                   max_model_len=opts.max_model_len if keep_len else plan.max_model_len)


def missing_services() -> list[str]:
    return [name for name in SERVICES if importlib.util.find_spec(f"services.{name}.__main__") is None]


async def up(opts: MeshOptions, grace: float | None, startup_timeout: float, emit: Emit = print_line,
             secure_bus: bool = True, kvstore_disk_dir: str | None = None, nats_tls: bool = False,
             nats_servers: int = 1, planner: PlannerConfig | None = None, planner_port: int = 0,
             drain_grace: float = 5.0) -> int:
    with secrets_dir() as secrets:
        return await _up(opts, grace, startup_timeout, emit, secure_bus, secrets, kvstore_disk_dir, nats_tls,
                         nats_servers, planner, planner_port, drain_grace)


async def _up(opts: MeshOptions, grace: float | None, startup_timeout: float, emit: Emit, secure_bus: bool,
              secrets_dir: Path, kvstore_disk_dir: str | None, nats_tls: bool = False, nats_servers: int = 1,
              planner: PlannerConfig | None = None, planner_port: int = 0, drain_grace: float = 5.0) -> int:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first Ctrl-C drains; a second one kills what is left
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    config_failures: list[str] = []

    def on_config_failure(name: str) -> None:
        # Prefill workers are optional (decode prefills locally without them); a decode worker whose
        # configuration cannot work means every decode worker fails the same way: stop the mesh.
        if name.startswith("decode"):
            config_failures.append(name)
            stop.set()

    supervisor = Supervisor(emit, on_config_failure=on_config_failure)
    # The mesh's secret: folded into every block hash, so blocks cannot be planted for a predicted prompt.
    # Only the engine workers hash blocks; the kvstore keeps them by hash and the gateway routes with the
    # hash root the workers' beats carry, so no other service gets it.
    cache_salt = secrets.token_hex(16)
    env: dict[str, str] = {}
    if grace is not None:
        env["KVMESH_GRACE_S"] = str(grace)  # the services read their --grace default from it
    nats_url = os.environ.get("NATS_URL")
    cluster: list[LocalNats] = []
    specs = mesh_services(opts)
    # With a planner, every instance it may start is planned now: bus identities and GPU placement for the
    # most workers of each role (a mesh at its maxima), so a new worker is a process like the first ones.
    full = {s.service: s for s in mesh_services(replace(opts, prefill=planner.limits["prefill"].max,
                                                        decode=planner.limits["decode"].max))} if planner else {}
    # One bus identity per process, named as the process (shared/bus/roles.py Identity.of): a leaked
    # credential speaks only for that process, never for the other workers of its role.
    instances = [spec.instance_name(i) for spec in specs for i in range(full.get(spec.service, spec).replicas)]
    if not nats_url:
        cluster = LocalNats.cluster(nats_servers, passwords=identity_passwords(instances) if secure_bus else None,
                                    config_dir=secrets_dir, tls=nats_tls)
        for server in cluster:
            await supervisor.start(server.process())
        for server in cluster:
            if not await server.wait_ready(timeout=15):
                emit(f"[kvmesh] {server.name} did not start")
                await supervisor.stop([s.name for s in cluster], timeout=5)
                return 1
        first = cluster[0]
        access = "one user per process, subject permissions" if first.passwords else "open (--insecure-bus)"
        access += ", TLS" if first.tls else ""
        for server in cluster:
            emit(f"[kvmesh] {server.name} at {server.url} (monitoring {server.monitor_url}; {access})")
        nats_url = ",".join(server.url for server in cluster)
    env["NATS_URL"] = nats_url

    def service_env(service: str) -> dict[str, str]:
        extra = {"KVMESH_CACHE_SALT": cache_salt} if service in ENGINE_SERVICES else {}
        if planner is not None and service in ENGINE_SERVICES:
            extra["KVMESH_GRACE_S"] = str(drain_grace)  # a drained worker's requests move on after this
        if service == "kvstore" and kvstore_disk_dir:
            extra["KVMESH_KVSTORE_DISK_DIR"] = kvstore_disk_dir  # blocks survive the mesh's restarts
        return {**env, **extra}

    services = [p for spec in specs for p in spec.processes(sys.executable, service_env(spec.service))]
    if cluster:
        services = [replace(p, env={**p.env, **_bus_env(cluster[0], p)}) for p in services]
    if len(cluster) > 1:  # spread the services: each starts at the next server and fails over along the list
        services = [replace(p, env={**p.env, "NATS_URL": _rotate(nats_url, i), "NATS_NO_RANDOMIZE": "1"})
                    for i, p in enumerate(services)]
    for proc in services:
        await supervisor.start(proc)
    base = f"http://{_client_host(opts.host)}:{opts.port}"
    problem = await wait_healthy(f"{base}/health", startup_timeout, supervisor, stop)
    order = {p.name: i for i, p in enumerate(services)}

    def process_for(role: str, index: int) -> ProcessSpec:
        spec = full[role]
        proc = ProcessSpec(spec.instance_name(index), (sys.executable, "-m", spec.module, *spec.args,
                                                       *spec.instance_args(index)),
                           {**spec.env, **service_env(role), **spec.instance_env(index)})
        if cluster:
            proc = replace(proc, env={**proc.env, **cluster[0].role_env(proc.name)})
        if len(cluster) > 1:
            i = order.setdefault(proc.name, len(order))
            proc = replace(proc, env={**proc.env, "NATS_URL": _rotate(nats_url, i), "NATS_NO_RANDOMIZE": "1"})
        return proc

    running_planner = None
    rc = 0
    if config_failures:
        emit(f"[kvmesh] {', '.join(config_failures)} cannot start with this configuration (see its error above)")
        rc = EXIT_CONFIG
    elif stop.is_set():
        rc = 130  # interrupted before the mesh was up
    elif problem:
        emit(f"[kvmesh] the mesh did not come up: {problem}")
        rc = 1
    else:
        simulated = " with SIMULATED engine workers (--engine sim)" if opts.engine == "sim" else ""
        emit(f"[kvmesh] {READY} {base}/v1 (health {base}/health){simulated}; Ctrl-C stops it")
        if planner is not None:
            scaler = SupervisorScaler(supervisor, process_for,
                                      {"prefill": list(range(opts.prefill)), "decode": list(range(opts.decode))},
                                      {r: full[r].replicas for r in ("prefill", "decode")},
                                      drain_timeout_s=drain_grace + DRAIN_MARGIN_S)
            running_planner = await start_planner(planner, scaler, f"{base}/metrics", opts.host, planner_port, emit)
        await stop.wait()
        if config_failures:
            rc = EXIT_CONFIG
    emit("[kvmesh] stopping (Ctrl-C again to kill)")
    if running_planner is not None:
        await running_planner.close()
    timeout = (grace if grace is not None else DEFAULT_GRACE_S) + DRAIN_MARGIN_S
    servers = {server.name for server in cluster}
    codes = await supervisor.stop([n for n in supervisor.children if n not in servers], timeout=timeout, hurry=hurry)
    # -SIGTERM is a clean stop too: a service still importing has no handler installed yet.
    unclean = {n: c for n, c in codes.items() if c not in (0, None, -signal.SIGTERM)}
    for name, code in unclean.items():
        emit(f"[kvmesh] {name} did not stop cleanly: {describe_exit(code)}")  # type: ignore[arg-type]
    await supervisor.stop([server.name for server in cluster], timeout=5)
    return rc or (1 if unclean else 0)


def _bus_env(server: LocalNats, proc: ProcessSpec) -> dict[str, str]:
    """The bus credentials of a process: its own identity's, or each member's for a pack of simulated workers."""
    if not proc.members:
        return server.role_env(proc.name)
    env = server.role_env(proc.members[0])
    creds = {m: {"user": e.get("NATS_USER"), "password": e.get("NATS_PASSWORD"),
                 "inbox_prefix": e.get("NATS_INBOX_PREFIX")} for m in proc.members if (e := server.role_env(m))}
    for k in ("NATS_USER", "NATS_PASSWORD", "NATS_INBOX_PREFIX"):
        env.pop(k, None)  # the members connect under their own names, from the JSON below
    if any(c["user"] for c in creds.values()):
        env[PACK_IDENTITIES_ENV] = json.dumps(creds)
    return env


def _rotate(urls: str, i: int) -> str:
    parts = urls.split(",")
    i %= len(parts)
    return ",".join(parts[i:] + parts[:i])


def _client_host(bind: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind, bind)
    return f"[{host}]" if ":" in host else host


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT is fine for uvicorn, which sets it
        return True
    except OSError:
        return False
