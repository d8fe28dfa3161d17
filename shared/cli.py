"""The `kvmesh` commands of the mesh itself, and the parser that any command table plugs into.

Each subcommand lives in its own module with add_arguments/run. The console entry (`kvmesh`) is
loadtest/cli.py, at the top of the import graph: it adds the `bench` group to these commands, so nothing
below it imports the benchmarks. `python -m shared.cli` runs the mesh's commands alone.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping

# name -> (module, help). Modules are imported lazily so `kvmesh --help` stays fast.
Table = Mapping[str, tuple[str, str]]
COMMANDS: dict[str, tuple[str, str]] = {
    "demo-model": ("shared.models.demo", "write the demo model: SmolLM2-135M-Instruct, or --random for tiny random weights"),
    "generate": ("shared.engine.interactive", "offline interactive generation with the engine"),
    "up": ("shared.launcher.up", "run the whole mesh (nats-server + every service) as local processes"),
    "serve": ("shared.launcher.serve", "run one service in the foreground: kvmesh serve <service> [flags]"),
}


def _add(sub, name: str, module: str, help_: str) -> None:
    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_, description=help_)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str], groups: Mapping[str, tuple[str, Table]] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: COMMANDS, then each group (name -> (help, its command table)) as
    `kvmesh <group> <command>`. Only the modules argv names (or every one, for --help) are imported."""
    parser = argparse.ArgumentParser(prog="kvmesh")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    for group, (group_help, table) in (groups or {}).items():
        gp = sub.add_parser(group, help=group_help)
        gsub = gp.add_subparsers(dest=group, required=True)
        which = argv[1] if wanted == group and len(argv) > 1 else None
        for name, (module, help_) in table.items():
            if wanted == group and which in (None, name, "-h", "--help"):
                _add(gsub, name, module, help_)
            else:
                gsub.add_parser(name, help=help_)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the parsed command."""
    if isinstance(getattr(args, "model", None), str):
        # --model may name a .gguf (or a directory holding one) wherever it takes a checkpoint directory:
        # converted once here (cached), so every command and every service it starts sees a directory.
        from shared.models.errors import CheckpointError
        from shared.models.model_source import resolve_model

        try:
            args.model = resolve_model(args.model)
        except CheckpointError as e:
            print(f"kvmesh: cannot load the model: {e}", file=sys.stderr)
            return 2
    return int(args._run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(build_parser(argv).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
