"""Writes docs/reference/cli.md from the real argparse parsers of `kvmesh`.

    python docs/gen_cli_reference.py           # rewrite docs/reference/cli.md
    python docs/gen_cli_reference.py --check   # exit 1 when the committed file is stale

The parsers are the ones the commands run: `loadtest.cli.build_parser` (the console entry) for `kvmesh <command>` and
`kvmesh bench <benchmark>`, `shared.service_runner.service_parser` for `kvmesh serve <service>`. Defaults
read from the environment (KVMESH_*, NATS_*, ...) are rendered as if it were empty, and the few that
depend on the machine (CPU count, host name, process id) by name, so the file is the same everywhere.
tests/test_docs.py fails when the file differs from what this script writes.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "cli.md"
ENV_PREFIXES = ("KVMESH_", "NATS_", "OPENAI_", "OTEL_")
ENV_NAMES = ("OUT",)


class _CpuCount(int):
    """os.cpu_count() while the parsers are built: a number that prints as its name."""

    def __str__(self) -> str:
        return "the number of CPUs"

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return str(self)


@contextlib.contextmanager
def _neutral_machine() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    cpu_count = os.cpu_count
    for k in saved:
        del os.environ[k]
    os.cpu_count = lambda: _CpuCount(cpu_count() or 1)  # type: ignore[assignment]
    try:
        yield
    finally:
        os.cpu_count = cpu_count  # type: ignore[assignment]
        os.environ.update(saved)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def collect() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) for every kvmesh command, in the order the reference lists them."""
    sys.path.insert(0, str(ROOT))
    from loadtest.cli import build_parser
    from shared.launcher.process_spec import SERVICES
    from shared.service_runner import service_parser

    out: list[tuple[str, argparse.ArgumentParser]] = []
    with _neutral_machine():
        for name, parser in _subparsers(build_parser(["--help"])).items():
            if name == "bench":
                continue
            out.append((f"kvmesh {name}", parser))
            if name == "serve":
                for service in SERVICES:
                    module = importlib.import_module(f"services.{service}.service")
                    parser = service_parser(service, module.add_arguments)
                    parser.description = (f"the {service} service alone, in the foreground (same as "
                                          f"`python -m services.{service}`)")
                    out.append((f"kvmesh serve {service}", parser))
        bench = _subparsers(build_parser(["bench"]))["bench"]
        bench.description = bench.description or "benchmarks: kvmesh bench <benchmark> [flags]"
        out.append(("kvmesh bench", bench))
        out.extend((f"kvmesh bench {name}", p) for name, p in _subparsers(bench).items())
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    fmt = argparse.HelpFormatter("kvmesh")
    if not action.option_strings:
        return f"`{fmt._metavar_formatter(action, action.dest)(1)[0]}`"
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    metavar = fmt._format_args(action, action.dest.upper())
    return ", ".join(f"`{s} {metavar}`" for s in action.option_strings)


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or d == [] or action.nargs == argparse.REMAINDER:
        return ""
    # A worker's default id is <role>-<host name>-<process id> (services/engine_worker.py).
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    text = str(d).replace(f"-{host}-{os.getpid()}", "-<host>-<pid>")
    text = text.replace(f"{ROOT}{os.sep}", "")  # a path inside the checkout, relative to it
    return f"`{_cell(text)}`" if text else '`""`'


def _help(action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = argparse.HelpFormatter("kvmesh")._expand_help(action) if "%" in action.help else action.help
    return _cell(text)


def render_parser(title: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"## `{title}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    subs = _subparsers(parser)
    if subs:
        lines += ["| subcommand | what it does |", "| --- | --- |"]
        for name in subs:
            helps = {a.dest: a.help for a in next(a for a in parser._actions
                                                  if isinstance(a, argparse._SubParsersAction))._choices_actions}
            lines.append(f"| [`{name}`](#{_anchor(f'{title} {name}')}) | {_cell(helps.get(name) or '')} |")
        lines.append("")
        return "\n".join(lines)
    rows = [a for a in parser._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    if rows:
        lines += ["| flag | default | description |", "| --- | --- | --- |"]
        lines += [f"| {_flag(a)} | {_default(a)} | {_help(a)} |" for a in rows]
        lines.append("")
    return "\n".join(lines)


def _anchor(title: str) -> str:
    # MkDocs' default slugify of a heading `kvmesh bench serve`: lower case, spaces to dashes.
    return "-".join(title.lower().split())


def render() -> str:
    sections = collect()
    head = [
        "# CLI reference",
        "",
        "<!-- Generated by docs/gen_cli_reference.py from the real parsers; do not edit by hand. -->",
        "",
        "Every `kvmesh` command and its flags, as `kvmesh <command> --help` prints them. Defaults that a",
        "`KVMESH_*` or `NATS_*` environment variable can change are shown for an empty environment;",
        "[Configuration](../configuration.md) says which variables those are. `kvmesh serve <service>` and",
        "`python -m services.<service>` take the same flags.",
        "",
        "| command | |",
        "| --- | --- |",
    ]
    head += [f"| [`{t}`](#{_anchor(t)}) | {_cell(p.description or '')} |" for t, p in sections]
    head.append("")
    return "\n".join(head + [render_parser(t, p) for t, p in sections]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed reference is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python docs/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
