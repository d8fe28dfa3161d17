"""Several simulated engine workers in one OS process (`kvmesh up --engine sim --sim-workers-per-process K`).

A simulated worker's own state is a few MB (scheduler, block manager, request table); what a process costs is
the interpreter plus torch and the engine modules, ~170 MiB PSS on this machine. 64 decode + 16 prefill
workers as 80 processes would take ~13.5 GiB, so the mesh-scale test packs them: one process, one event loop,
and per worker everything a separate process would have had: its own NATS connection under its own bus
identity (the launcher's per-instance user, so a worker still speaks only for itself), its own engine thread,
its own subjects, beats and drain. The workers are the ordinary DecodeService / PrefillService, built from the
same flags a one-worker process gets; only the process around them is shared.

Only for `--engine sim`: a real engine's compute thread wants the process's cores to itself.

    python -m services.sim_pack --role decode --worker-ids decode-0,decode-1 --engine sim --model DIR ...

Credentials: KVMESH_PACK_IDENTITIES, a JSON object {worker id: {"user", "password", "inbox_prefix"}} (what
NATS_USER / NATS_PASSWORD / NATS_INBOX_PREFIX would be for a one-worker process); absent on an open bus.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from shared.engine.errors import EXIT_CONFIG, ConfigError, MemoryBudgetError
from shared.launcher.process_spec import PACK_IDENTITIES_ENV as IDENTITIES_ENV
from shared.service_runner import Hosted, add_common_arguments, run_services

log = logging.getLogger(__name__)


def _role_module(role: str):  # noqa: ANN202 - one of the two engine services' modules
    if role == "decode":
        from services.decode import service
    else:
        from services.prefill import service
    return service


def parse(argv: list[str] | None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--role", choices=["decode", "prefill"], required=True)
    role = pre.parse_known_args(argv)[0].role
    parser = argparse.ArgumentParser(prog="python -m services.sim_pack")
    parser.add_argument("--role", choices=["decode", "prefill"], required=True)
    parser.add_argument("--worker-ids", required=True, help="comma-separated ids of the workers this process runs")
    add_common_arguments(parser)
    _role_module(role).add_arguments(parser)
    args = parser.parse_args(argv)
    if args.engine != "sim":
        parser.error("several workers per process is for simulated workers only (--engine sim)")
    args.worker_ids = [w for w in args.worker_ids.split(",") if w]
    if not args.worker_ids or len(set(args.worker_ids)) != len(args.worker_ids):
        parser.error("--worker-ids: one or more distinct ids")
    return args


def members(args: argparse.Namespace, identities: dict[str, dict]) -> list[Hosted]:
    module = _role_module(args.role)
    out = []
    for wid in args.worker_ids:
        ident = identities.get(wid)
        if identities and ident is None:
            raise ConfigError(f"{IDENTITIES_ENV} has no bus identity for {wid}")
        one = argparse.Namespace(**vars(args))
        one.worker_id = wid
        opts = {k: ident[k] for k in ("user", "password", "inbox_prefix") if ident and ident.get(k)}
        out.append(Hosted(module.build(one), f"kvmesh-{args.role}-{wid}", opts))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.model:
        from shared.models.model_source import resolve_model

        args.model = resolve_model(args.model)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.role}-pack %(levelname)s %(name)s: %(message)s")
    try:
        identities = json.loads(os.environ.get(IDENTITIES_ENV, "") or "{}")
        return asyncio.run(run_services(args.role, members(args, identities), args.nats_url, args.grace))
    except (MemoryBudgetError, ConfigError, json.JSONDecodeError) as e:
        print(f"kvmesh {args.role} pack: cannot start: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
