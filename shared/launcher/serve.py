"""`kvmesh serve <service> [service flags]`: one service in the foreground, same as
`python -m services.<service>` (both go through shared.service_runner.main_for)."""
from __future__ import annotations

import argparse
import importlib
import sys

from shared.launcher.process_spec import SERVICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("service", choices=SERVICES, help="which service to run")
    # Everything after the service name is the service's own (`kvmesh serve decode --help`).
    parser.add_argument("service_args", nargs=argparse.REMAINDER, help="the service's flags")


def run(args: argparse.Namespace) -> int:
    module_name = f"services.{args.service}.service"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the service module (or its package) missing is "not available"; a missing
        # dependency inside the service is a real error and keeps its traceback.
        if not e.name or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise
        print(f"kvmesh serve: service {args.service!r} is not available ({module_name} not found)", file=sys.stderr)
        return 2
    from shared.service_runner import main_for

    return main_for(args.service, module.add_arguments, module.build, args.service_args)
