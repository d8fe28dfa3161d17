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
import signal
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from shared.engine.errors import EXIT_CONFIG, ConfigError
from shared.models.errors import CheckpointError
from shared.engine.lora_config import add_lora_arguments, lora_service_args
from shared.gateway_flags import add_gateway_flags
from shared.launcher.gpu_plan import (WORKER_DEFAULTS, PlanError, gpu_memory_from_nvidia_smi, parse_gpu_memory,
                                     plan_mesh, plan_models, worker_needs)
from shared.engine.cpu_threads import worker_env
from shared.launcher.cpu_layout import cpu_default_layout
from shared.launcher.gpus import parse_devices
from shared.launcher import mesh_secret
from shared.bus.roles import inbox_prefix
from shared.launcher.host_agent import planner_entry
from shared.launcher.join import host_tag
from shared.launcher.join_file import JoinFile
from shared.planner.remote_scaler import PLANNER_USER, RemoteHostScaler, RemoteScaleError
from shared.launcher.local_nats import LocalNats, identity_passwords
from shared.launcher.model_flags import COUNT_ROLES, ModelFlagError, served_models
from shared.launcher.readiness import wait_healthy
from shared.launcher.secrets_dir import secrets_dir
from shared.private_dir import UnsafeDirectory, private_dir, user_cache_dir
from shared.salt_tag import model_salts, salt_tag
from shared.engine.sim_profile import ProfileError
from shared.launcher.planned import start_planner
from shared.launcher.pooling_mesh import add_pooling_arguments, pooling_options
from shared.launcher.process_spec import (DEFAULT_MODEL, DEFAULT_PORT, ENGINE_SERVICES, MODEL_SERVICES,
                                          PACK_IDENTITIES_ENV, SERVICES, MeshOptions, ProcessSpec, ServiceSpec,
                                          mesh_services)
from shared.planner.config import PlannerConfig, PlannerConfigError, RoleLimits
from shared.planner.scaler import SupervisorScaler
from shared.launcher.supervisor import Emit, Supervisor, describe_exit, print_line
from shared.models.model_config import load_model_config
from shared.service_runner import DEFAULT_GRACE_S
from shared.spec_config import SpeculativeConfig
from shared.subjects import NAMESPACE_ENV, model_namespace

READY = "kvmesh is up at"  # tests wait for this line
# A service drains for up to its grace period, then its NATS connection for up to 5 s more
# (shared/service_runner.py); SIGKILL only after that.
DRAIN_MARGIN_S = 10.0


# Weight-only formats of the CPU path: refused for workers placed on GPUs (fp8, awq, gptq serve on both).
CPU_ONLY_QUANTIZATION = ("gguf", "gguf-hybrid", "int8", "int4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MeshOptions()
    parser.add_argument("--model", action="append", default=None,
                        help=f"HF model directory or .gguf file (default {DEFAULT_MODEL}, written as the demo model if "
                             "missing); repeat it to serve several models, each with its own workers")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="model name in the API (default: the model directory's name); repeatable, one per "
                             "--model in the same order")
    parser.add_argument("--host", default=d.host, help=f"gateway bind address (default {d.host})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gateway port (default {DEFAULT_PORT})")
    per_model = "; with several models N for each, or NAME=N,NAME=N per model"
    parser.add_argument("--prefill", default=None, metavar="N",
                        help=f"prefill workers (default {d.prefill} on GPUs, or 0 when the GPU plan needs it; 0 on CPU, where "
                             f"a prefill worker shares decode's cores; 0: all prefill local){per_model}")
    parser.add_argument("--decode", default=None, metavar="N", help=f"decode workers (default {d.decode}){per_model}")
    parser.add_argument("--tokenizer", default=None, metavar="N",
                        help=f"tokenizer workers (default {d.tokenizer}){per_model}")
    parser.add_argument("--kvstore", type=int, default=d.kvstore, help=f"kvstore replicas (default {d.kvstore}; 0: none)")
    parser.add_argument("--remote-prefill-threshold", type=int, default=None, metavar="TOKENS",
                        help="uncached prompt tokens from which decode prefills remotely (0: always; default: decode's own)")
    parser.add_argument("--remote-prefill-timeout-per-token", type=float, default=None, metavar="SECONDS",
                        help="seconds a remote prefill may take per uncached prompt token (plus 2 s) before decode "
                             "prefills locally (default: decode's own, 0.002 on GPUs, 0.02 on CPUs)")
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
                        choices=["auto", "none", "gguf", "gguf-hybrid", "int8", "int4", "fp8", "awq", "gptq"],
                        help="every engine worker's linear layers. GPU (CPU through the reference path): fp8 (W8A8, "
                             "sm_89+; an FP8 checkpoint as published, or a bf16 one quantized at load), awq / gptq "
                             "(4-bit checkpoints). CPU only: int8 (per row) or int4 (groups of 32): 2-4x fewer bytes "
                             "a decode step than bf16; gguf: a GGUF's Q4_0/Q4_1/Q8_0 weights as stored (gguf-hybrid: "
                             "plus a bf16 copy for steps of more than 4 rows); none: dequantized (default, auto: the "
                             "checkpoint's quantization_config, gguf-hybrid for a GGUF model served in bf16 on CPU)")
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
    parser.add_argument("--kvstore-disk-dir", default=None,
                        help="the kvstore's persistent disk tier (default $XDG_CACHE_HOME/kvmesh/kvstore, i.e. "
                             "~/.cache/kvmesh/kvstore; 'none': memory only), a directory only this user "
                             "can read (made 0700; refused if another user owns it or can write it); its records "
                             "are wiped at start unless KVMESH_CACHE_SALT gives the mesh the same secret again")
    parser.add_argument("--nats-tls", action="store_true",
                        help="the local nats-server requires TLS (a throwaway CA and certificate for this run)")
    parser.add_argument("--nats-servers", type=int, default=1, metavar="N",
                        help="run the local NATS as a cluster of N servers joined by routes (default 1); services "
                             "are spread over them and fail over to another when theirs goes away")
    parser.add_argument("--nats-monitor", action="store_true",
                        help="the local nats-server(s) also serve their monitoring pages (/varz, /connz, /subsz) on "
                             "a loopback port; off by default: the pages have no authentication and list every "
                             "connection's subscriptions to any local user")
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
    add_gateway_flags(parser, launcher=True)
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="compute threads of each CPU engine worker, affinity left as it is (default: each its "
                             "share of this host's usable cores, pinned to its own cores when there are several)")
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
    parser.add_argument("--advertise-host", default=None, metavar="ADDR",
                        help="a mesh over several hosts: the address other hosts reach this one at; the local "
                             "nats-server (clients and routes) and the decode workers' KV channel listen there")
    parser.add_argument("--write-join", default=None, metavar="FILE",
                        help="first host of a multi-host mesh: write the join file (route URLs, CA, mesh secret; "
                             "readable by you only) other hosts join with; needs --advertise-host")
    parser.add_argument("--join", default=None, metavar="FILE",
                        help="join the mesh another host started with --write-join: run only this host's "
                             "--prefill/--decode workers (default 0/1) and a nats-server routed into the mesh")
    parser.add_argument("--planner-host", default=None, metavar="NAME",
                        help="--planner with --write-join: scale the workers of the joined host of this --host-name "
                             "(its launcher starts and drains them) instead of this host's")
    parser.add_argument("--host-name", default=None, metavar="NAME",
                        help="--join: this host's tag in its worker names (default: the hostname)")
    add_pooling_arguments(parser)
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
    given = args.model or []
    model = Path(given[0]) if given else DEFAULT_MODEL
    try:
        models = served_models([str(model), *given[1:]], args.served_model_name or [],
                               {r: getattr(args, r) for r in COUNT_ROLES},
                               {r: getattr(MeshOptions, r) for r in COUNT_ROLES})
        first = models[0]
        pooling = pooling_options(args, first.prefill if args.prefill is not None else None)
        opts = MeshOptions(
            model=str(model), host=args.host, port=args.port, served_model_name=first.served_model_name,
            tokenizer=first.tokenizer, more_models=models[1:], max_model_len=args.max_model_len,
            remote_prefill_threshold=args.remote_prefill_threshold,
            remote_prefill_timeout_per_token=args.remote_prefill_timeout_per_token, log_level=args.log_level,
            devices=parse_devices(args.devices), gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, host_kv_bytes=args.host_kv_bytes,
            async_scheduling=args.async_scheduling,
            quantization=args.quantization, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
            engine=args.engine, speculative_config=_speculative_config(args.speculative_config),
            share_suffix_outputs=args.share_suffix_outputs,
            sim_profile=str(Path(args.sim_profile).resolve()) if args.sim_profile else None, sim_speed=args.sim_speed,
            sim_workers_per_process=args.sim_workers_per_process, routing=args.routing,
            max_inflight_requests=args.max_inflight_requests, max_queue_wait=args.max_queue_wait,
            max_request_tokens=args.max_request_tokens, stream_write_timeout=args.stream_write_timeout,
            threads=args.threads,
            trust_request_chat_template=args.trust_request_chat_template, scheduling_policy=args.scheduling_policy,
            trusted_hosts=args.trusted_hosts,
            max_num_seqs=args.max_num_seqs,
            decode_tp=args.decode_tp or args.tensor_parallel_size,
            prefill_tp=args.prefill_tp or args.tensor_parallel_size,
            remote_workers=bool(args.write_join or args.join),
            # a pooling mesh (--runner pooling) has its own worker counts: prefill workers only, no kvstore
            **({"prefill": first.prefill, "decode": first.decode, "kvstore": args.kvstore} | pooling),
            lora_engine_args=tuple(lora_service_args(args, engine=True)),
            lora_gateway_args=tuple(lora_service_args(args, engine=False)),
        )
        opts = opts.with_models(tuple(replace(m, max_model_len=args.max_model_len) for m in opts.models))
    except (AssertionError, ConfigError, ModelFlagError, ValueError) as e:
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
    if opts.quantization in CPU_ONLY_QUANTIZATION and opts.devices:
        print(f"kvmesh up: --quantization {opts.quantization} is weight-only quantization for CPU workers; the "
              f"workers here go on GPUs {','.join(opts.devices)} (add --devices none to serve on the CPU)",
              file=sys.stderr)
        return 2
    missing = missing_services()
    if missing:
        print("kvmesh up: cannot start the mesh, service module(s) missing: "
              + ", ".join(f"services.{m} (services/{m}/__main__.py)" for m in missing), file=sys.stderr)
        return 2
    if args.join or args.write_join:
        problem = _multi_host_problem(args)
        if problem:
            print(f"kvmesh up: {problem}", file=sys.stderr)
            return 2
    if args.join:
        return _run_joined(args, opts, model)
    if not args.dry_run and not _port_free(opts.host, opts.port):
        # Else the gateway would crash-loop, and whatever holds the port might even answer /health.
        print(f"kvmesh up: {opts.host}:{opts.port} is in use; pick another port with --port", file=sys.stderr)
        return 2
    if opts.host not in ("localhost", "::1") and not opts.host.startswith("127.") and not os.environ.get("KVMESH_API_KEY"):
        print(f"kvmesh up: WARNING: SECURITY: the gateway will listen on {opts.host}, beyond this machine, with no "
              "API key: anyone who can reach it can use the model. Set KVMESH_API_KEY (or bind to 127.0.0.1).",
              file=sys.stderr)
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
        if not args.planner_host:  # with --planner-host the limits are the other host's: this host keeps its own
            opts = opts.with_models(tuple(
                replace(m, prefill=min(lim["prefill"].max, max(lim["prefill"].min, m.prefill)),
                        decode=min(lim["decode"].max, max(lim["decode"].min, m.decode))) for m in opts.models))
        if opts.total("prefill") == 0 and opts.remote_prefill_threshold is None:
            # Prefill workers may come later: decode must keep asking for them (it prefills locally meanwhile).
            opts = replace(opts, remote_prefill_threshold=planner.remote_prefill_threshold)
    if opts.more_models or args.model is not None:
        try:
            # A .gguf becomes its converted checkpoint directory here, so every worker and the gateway start from
            # the same directory (the default first model is the demo model, written below when missing).
            opts = opts.with_models(tuple(m if i == 0 and args.model is None else replace(m, model=checkpoint_dir(m.model))
                                          for i, m in enumerate(opts.models)))
        except CheckpointError as e:
            print(f"kvmesh up: {e}", file=sys.stderr)
            return 2
        model = Path(opts.model)
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
    opts, note = cpu_default_layout(opts, args.prefill is not None or args.remote_prefill_threshold is not None
                                    or opts.runner == "pooling", planned=planner is not None)
    if note:
        print(note, flush=True)
    if args.dry_run:
        for spec in mesh_services(opts):
            for proc in spec.processes(sys.executable, {}):
                print(f"{proc.name}: {' '.join(proc.argv[1:])}" + "".join(f" {k}={v}" for k, v in proc.env.items()
                                                                        if k in ("CUDA_VISIBLE_DEVICES", NAMESPACE_ENV)))
        return 0
    disk_dir = args.kvstore_disk_dir or str(user_cache_dir("kvmesh", "kvstore"))
    disk = None if disk_dir.lower() == "none" or opts.kvstore == 0 else str(Path(disk_dir).resolve())
    try:  # the kvstore checks it too; a directory it would refuse stops the launch here, with the reason
        if disk is not None:
            private_dir(disk)
    except UnsafeDirectory as e:
        print(f"kvmesh up: --kvstore-disk-dir: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if planner is not None and not planner.budget and opts.devices and not opts.more_models:
        planner = replace(planner, budget=opts.prefill + opts.decode)  # the GPU plan's capacity
    return asyncio.run(up(opts, grace=args.grace, startup_timeout=args.startup_timeout, secure_bus=not args.insecure_bus,
                          kvstore_disk_dir=disk, nats_tls=args.nats_tls, nats_servers=args.nats_servers,
                          nats_monitor=args.nats_monitor,
                          planner=planner, planner_port=args.planner_port, drain_grace=args.drain_grace,
                          advertise_host=args.advertise_host,
                          write_join=Path(args.write_join) if args.write_join else None,
                          planner_host=host_tag(args.planner_host) if args.planner_host else None))


def _multi_host_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the multi-host flags (--join, --write-join), or None."""
    if args.join and args.write_join:
        return "--join and --write-join exclude each other (a host either starts the mesh or joins it)"
    if os.environ.get("NATS_URL"):
        return "--join/--write-join run this host's own nats-server: unset NATS_URL"
    if args.write_join and not args.advertise_host:
        return "--write-join needs --advertise-host (the address the other hosts reach this one at)"
    if args.join and args.planner:
        return "--planner runs on the host that started the mesh, not on a joined one"
    if args.planner_host and not (args.planner and args.write_join):
        return "--planner-host needs --planner and --write-join (the planner scales a host that joined this mesh)"
    return None


def _run_joined(args: argparse.Namespace, opts: MeshOptions, model: Path) -> int:
    from shared.launcher.join import host_tag, run_joined
    from shared.launcher.join_file import JoinFile, JoinFileError
    from shared.launcher.mesh_addr import address_towards

    try:
        join = JoinFile.read(Path(args.join))
    except JoinFileError as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 2
    if not (model / "config.json").is_file():
        print(f"kvmesh up: {model} is not a model directory (no config.json): every host needs the model",
              file=sys.stderr)
        return 2
    try:  # a joined host runs workers of the mesh's one model: plain counts
        prefill = int(args.prefill or 0)
        decode = 1 if args.decode is None else int(args.decode)
    except ValueError:
        print("kvmesh up: --join takes plain worker counts (--prefill N --decode M)", file=sys.stderr)
        return 2
    if prefill < 0 or decode < 0 or prefill + decode == 0:
        print("kvmesh up: --join needs some workers to run (--prefill N and/or --decode M)", file=sys.stderr)
        return 2
    advertise = args.advertise_host or address_towards(join.routes[0])
    return asyncio.run(run_joined(opts, join, advertise, host_tag(args.host_name), prefill, decode, args.grace,
                                  args.nats_servers, most={"prefill": args.prefill_max, "decode": args.decode_max}))


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
    if opts.more_models:
        return _plan_models(opts, sizes)
    cfg = load_model_config(opts.model)
    d = WORKER_DEFAULTS
    needs = worker_needs(cfg, "auto", opts.kv_cache_dtype or "auto", d.max_num_batched_tokens,
                         opts.max_num_seqs or d.max_num_seqs, quantization=opts.quantization)
    plan = plan_mesh(opts, sizes, needs, cfg.max_position_embeddings, d.block_size, layout_given)
    print(plan.table(), flush=True)
    keep_len = plan.max_model_len == (opts.max_model_len or cfg.max_position_embeddings)
    return replace(opts, prefill=plan.prefill, decode=plan.decode,
                   max_model_len=opts.max_model_len if keep_len else plan.max_model_len)


def _plan_models(opts: MeshOptions, sizes: dict[str, int]) -> MeshOptions:
    """Several models: each model's workers checked against their shares with that model's needs (the layout
    is kept; a model's context shrinks to what its workers hold)."""
    d = WORKER_DEFAULTS
    cfgs = [load_model_config(m.model) for m in opts.models]
    needs = [worker_needs(c, "auto", opts.kv_cache_dtype or "auto", d.max_num_batched_tokens,
                          opts.max_num_seqs or d.max_num_seqs, quantization=opts.quantization) for c in cfgs]
    plans = plan_models(opts, sizes, needs, [c.max_position_embeddings for c in cfgs], d.block_size)
    for m, plan in zip(opts.models, plans):
        print(f"[{m.name}] " + plan.table(), flush=True)
    return opts.with_models(tuple(
        replace(m, max_model_len=m.max_model_len if plan.max_model_len == (m.max_model_len or c.max_position_embeddings)
                else plan.max_model_len) for m, plan, c in zip(opts.models, plans, cfgs)))


def checkpoint_dir(model: str) -> str:
    """A model of a several-model mesh as its checkpoint directory: a .gguf is converted once here (cached), so
    every model's workers and the gateway start from the same directory and its config.json plans the GPUs."""
    from shared.models.model_source import gguf_file_of, resolve_model

    if gguf_file_of(model) is not None:
        return resolve_model(model)
    if not (Path(model) / "config.json").is_file():
        raise CheckpointError(Path(model), "config.json", "not a model directory (no config.json)")
    return model


def missing_services() -> list[str]:
    return [name for name in SERVICES if importlib.util.find_spec(f"services.{name}.__main__") is None]


async def up(opts: MeshOptions, grace: float | None, startup_timeout: float, emit: Emit = print_line,
             secure_bus: bool = True, kvstore_disk_dir: str | None = None, nats_tls: bool = False,
             nats_servers: int = 1, planner: PlannerConfig | None = None, planner_port: int = 0,
             drain_grace: float = 5.0, nats_monitor: bool = False, advertise_host: str | None = None,
             write_join: Path | None = None, planner_host: str | None = None) -> int:
    with secrets_dir() as secrets:
        return await _up(opts, grace, startup_timeout, emit, secure_bus, secrets, kvstore_disk_dir, nats_tls,
                         nats_servers, planner, planner_port, drain_grace, nats_monitor, advertise_host, write_join,
                         planner_host)


async def _up(opts: MeshOptions, grace: float | None, startup_timeout: float, emit: Emit, secure_bus: bool,
              secrets_dir: Path, kvstore_disk_dir: str | None, nats_tls: bool = False, nats_servers: int = 1,
              planner: PlannerConfig | None = None, planner_port: int = 0, drain_grace: float = 5.0,
              nats_monitor: bool = False, advertise_host: str | None = None, write_join: Path | None = None,
              planner_host: str | None = None) -> int:
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
        if name.startswith("decode") or (opts.runner == "pooling" and name.startswith("prefill")):
            config_failures.append(name)
            stop.set()

    supervisor = Supervisor(emit, on_config_failure=on_config_failure)
    # The mesh's secret: folded into every block hash, so blocks cannot be planted for a predicted prompt.
    # Only the engine workers hash blocks; the kvstore keeps them by hash and the gateway routes with the
    # hash root the workers' beats carry, so no other service gets it.
    # Other hosts join with a file holding the mesh secret, from which every host derives the route password,
    # its own processes' passwords and the salt (shared/launcher/mesh_secret.py). Otherwise a salt given in the
    # environment (the user's own secret) keeps the disk tier's records usable across runs.
    mesh_key = mesh_secret.new_secret() if write_join else None
    base_salt = mesh_secret.cache_salt(mesh_key) if mesh_key else os.environ.get("KVMESH_CACHE_SALT")
    # Each model its own: no block of one model ever matches another's.
    cache_salts = model_salts(base_salt, len(opts.models))
    env: dict[str, str] = {}
    if grace is not None:
        env["KVMESH_GRACE_S"] = str(grace)  # the services read their --grace default from it
    nats_url = os.environ.get("NATS_URL")
    cluster: list[LocalNats] = []
    specs = mesh_services(opts)
    # With a planner, every instance it may start is planned now: bus identities and GPU placement for the
    # most workers of each role (a mesh at its maxima), so a new worker is a process like the first ones.
    # Several models: each model is planned apart, within the same limits.
    full: dict[tuple[str, int], ServiceSpec] = {}
    if planner:
        full = {(s.service, s.model_index): s for s in mesh_services(opts.with_models(tuple(
            replace(m, prefill=planner.limits["prefill"].max, decode=planner.limits["decode"].max)
            for m in opts.models)))}
        if opts.more_models:  # a later model's instances are numbered after the earlier models' maxima
            specs = [replace(s, first_index=f.first_index, placement=f.placement)
                     if (f := full.get((s.service, s.model_index))) else s for s in specs]
    # One bus identity per process, named as the process (shared/bus/roles.py Identity.of): a leaked
    # credential speaks only for that process, never for the other workers of its role.
    instances = [spec.instance_name(i) for spec in specs
                 for i in range(full.get((spec.service, spec.model_index), spec).replicas)]
    if not nats_url:
        cluster = LocalNats.cluster(nats_servers, advertise_host or "127.0.0.1",
                                    passwords=identity_passwords(instances) if secure_bus else None,
                                    config_dir=secrets_dir, tls=nats_tls, monitor=nats_monitor,
                                    namespaces=bus_namespaces(specs, full, len(opts.models)),
                                    route_password=mesh_secret.route_password(mesh_key) if mesh_key else None,
                                    extra_users=(planner_entry(mesh_secret.process_password(mesh_key, PLANNER_USER)),)
                                    if mesh_key and planner_host and secure_bus else ())
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
            emit(f"[kvmesh] {server.name} at {server.url} (monitoring {server.monitor_url or 'off'}; {access})")
        nats_url = ",".join(server.url for server in cluster)
        if mesh_key and write_join:
            write_join_file(write_join, mesh_key, cluster, opts, secure_bus)
            emit(f"[kvmesh] join file {write_join}: other hosts join with `kvmesh up --join {write_join.name} "
                 f"--advertise-host THEIR_ADDR --decode N` (it holds the mesh secret: copy it as one)")
    env["NATS_URL"] = nats_url
    if advertise_host:
        env["KVMESH_KV_HOST"] = advertise_host  # other hosts' prefill workers push KV to this address

    def service_env(service: str, model_index: int = 0) -> dict[str, str]:
        extra = {"KVMESH_CACHE_SALT": cache_salts[model_index]} if service in ENGINE_SERVICES else {}
        if planner is not None and service in ENGINE_SERVICES:
            extra["KVMESH_GRACE_S"] = str(drain_grace)  # a drained worker's requests move on after this
        if service == "kvstore" and kvstore_disk_dir:
            extra["KVMESH_KVSTORE_DISK_DIR"] = kvstore_disk_dir  # blocks survive the mesh's restarts
            extra["KVMESH_KVSTORE_SALT_TAG"] = salt_tag(",".join(cache_salts))  # and records of another salt are wiped
        return {**env, **extra}

    services = [p for spec in specs for p in spec.processes(sys.executable, service_env(spec.service, spec.model_index))]
    # CPU engine workers: each its own share of the cores (and every worker a planner may start counted).
    cpu_env = {} if opts.devices or opts.engine != "real" else worker_env(
        (s.instance_name(i), opts.tp(s.service)) for s in (full.values() if planner else specs)
        if s.service in ENGINE_SERVICES for i in range(s.replicas))
    services = [replace(p, env={**p.env, **cpu_env.get(p.name, {})}) for p in services]
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

    def process_for(role: str, index: int, model_index: int = 0) -> ProcessSpec:
        spec = full[role, model_index]
        proc = ProcessSpec(spec.instance_name(index), (sys.executable, "-m", spec.module, *spec.args,
                                                       *spec.instance_args(index)),
                           {**spec.env, **service_env(role, model_index), **spec.instance_env(index),
                            **cpu_env.get(spec.instance_name(index), {})})
        if cluster:
            proc = replace(proc, env={**proc.env, **cluster[0].role_env(proc.name)})
        if len(cluster) > 1:
            i = order.setdefault(proc.name, len(order))
            proc = replace(proc, env={**proc.env, "NATS_URL": _rotate(nats_url, i), "NATS_NO_RANDOMIZE": "1"})
        return proc

    running_planners = []
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
        if planner is not None and planner_host:
            remote = await remote_scaler(cluster[0], planner_host, mesh_key, emit)
            running_planners.append(await start_planner(planner, remote, f"{base}/metrics", opts.host, planner_port,
                                                        emit))
        for k, m in enumerate(opts.models if planner is not None and not planner_host else ()):
            # One planner per model: it reads that model's series and scales that model's workers.
            scaler = SupervisorScaler(supervisor, partial(process_for, model_index=k),
                                      {"prefill": list(range(m.prefill)), "decode": list(range(m.decode))},
                                      {r: full[r, k].replicas for r in ("prefill", "decode")},
                                      drain_timeout_s=drain_grace + DRAIN_MARGIN_S)
            own = planner
            if opts.more_models and not planner.budget and opts.devices:
                own = replace(planner, budget=m.prefill + m.decode)  # the GPU plan's capacity for the model
            running_planners.append(await start_planner(
                own, scaler, f"{base}/metrics", opts.host, planner_port if k == 0 else 0, emit,
                model=m.name if opts.more_models else None))
        await stop.wait()
        if config_failures:
            rc = EXIT_CONFIG
    emit("[kvmesh] stopping (Ctrl-C again to kill)")
    for running_planner in running_planners:
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


def bus_namespaces(specs: list[ServiceSpec], full: dict[tuple[str, int], ServiceSpec],
                   models: int) -> dict[str, tuple[str, ...]]:
    """Bus user -> the subject namespaces it may use: a model's workers its model's, the gateway every model's."""
    out: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        for i in range(full.get((spec.service, spec.model_index), spec).replicas):
            if spec.service == "gateway":
                out[spec.instance_name(i)] = tuple(model_namespace(k) for k in range(models))
            elif spec.service in MODEL_SERVICES:
                out[spec.instance_name(i)] = (model_namespace(spec.model_index),)
    return out


async def remote_scaler(server: LocalNats, host: str, mesh_key: str | None, emit: Emit) -> RemoteHostScaler:
    """The planner's connection to the bus (its own user) and the scaler of the joined host `host`."""
    import nats

    kwargs: dict = {"servers": [server.url], "name": PLANNER_USER, "max_reconnect_attempts": -1}
    if server.passwords and mesh_key:
        kwargs |= {"user": PLANNER_USER, "password": mesh_secret.process_password(mesh_key, PLANNER_USER),
                   "inbox_prefix": inbox_prefix(PLANNER_USER)}
    if server.tls:
        import ssl

        kwargs["tls"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(server.tls.ca))
    scaler = RemoteHostScaler(await nats.connect(**kwargs), host, {"prefill": 0, "decode": 0})
    try:
        await scaler.refresh()
    except RemoteScaleError as e:
        emit(f"[kvmesh] planner: {e}; it scales that host once it answers")
    return scaler


def write_join_file(path: Path, mesh_key: str, cluster: list[LocalNats], opts: MeshOptions, secure_bus: bool) -> Path:
    tls = cluster[0].tls
    return JoinFile(mesh_key, tuple(s.route_url for s in cluster), secure_bus,
                    tls.ca.read_text() if tls else None, (tls.ca.parent / "ca.key").read_text() if tls else None,
                    opts.served_model_name, opts.kvstore > 0, opts.prefill).write(path)


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
