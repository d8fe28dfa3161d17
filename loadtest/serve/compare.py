"""`kvmesh bench compare`: one workload (same seed, same prompts) against two servers, side by side.

    kvmesh bench compare --a http://127.0.0.1:8000,/models/demo,kvmesh \
                         --b http://127.0.0.1:8001,/models/demo,transformers \
                         --sweep-concurrency 1,4,16,64 --ratio a/b --json cmp.json --plot cmp/

Servers are given as URL,MODEL[,NAME]. Levels alternate between the servers, and which one goes
first alternates too (a b, b a, a b, ...), so slow drift on the machine does not favour one side.
Ratios are numerator/denominator as --ratio says (default b/a); for latencies above 1 means the
numerator is slower, for throughputs above 1 means it is faster.
Exit codes as `bench serve`: 0 done, 1 not one request succeeded on either server, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

from . import options as opt
from .datasets import Workload
from .metrics import Summary, parse_goodput
from .plots import write_plots
from .report import ServeReport, grid, level_table, write_json
from .runner import EXIT_ALL_FAILED, EXIT_BAD_ARGS, EXIT_OK, measure, prepare, series

SCHEMA = "kvmesh.bench.compare/1"

# (label, how to read it from a Summary); the ratio rows of the table and JSON.
FIGURES: dict[str, object] = {
    "request_throughput": lambda s: s.request_throughput,
    "output_throughput": lambda s: s.output_throughput,
    "ttft_p50_ms": lambda s: s.ttft_ms.median,
    "ttft_p99_ms": lambda s: s.ttft_ms.p99,
    "itl_p50_ms": lambda s: s.itl_ms.median,
    "itl_p99_ms": lambda s: s.itl_ms.p99,
    "tpot_p50_ms": lambda s: s.tpot_ms.median,
    "e2el_p50_ms": lambda s: s.e2el_ms.median,
    "goodput": lambda s: s.goodput,
}


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    name: str


def parse_target(text: str, default_name: str) -> Target:
    parts = text.split(",")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"expected URL,MODEL[,NAME], got {text!r}")
    return Target(parts[0], parts[1], parts[2] if len(parts) == 3 else default_name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("--a", required=True, metavar="URL,MODEL[,NAME]")
    p.add_argument("--b", required=True, metavar="URL,MODEL[,NAME]")
    p.add_argument("--ratio", choices=["b/a", "a/b"], default="b/a", help="which way ratios are taken")
    opt.add_request_arguments(p)
    opt.add_dataset_arguments(p)
    opt.add_load_arguments(p)
    opt.add_output_arguments(p)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def figures(s: Summary) -> dict[str, float | None]:
    return {k: f(s) for k, f in FIGURES.items()}  # type: ignore[operator]


async def _run(args, targets: list[Target], workload: Workload, slo: dict[str, float]) -> list[ServeReport]:
    deadline = time.perf_counter() + args.time_limit
    reports, endpoints = [], []
    for t in targets:
        ep, probe = await prepare(opt.build_endpoint(args, t.url, t.model), args, deadline)
        endpoints.append(ep)
        reports.append(ServeReport(opt.describe_target(ep) | {"name": t.name}, {"mode": probe.mode.value, "note": probe.note},
                                   opt.describe_workload(workload, args), opt.describe_load(args)))
    for i, level in enumerate(opt.levels(args)):
        level_workload = opt.workload_for_level(args, workload, i)
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            if time.perf_counter() >= deadline:
                reports[j].skipped_levels.append(level)
                continue
            label = f"{targets[j].name} concurrency {level}"
            reports[j].levels.append(await measure(endpoints[j], level_workload, args, level, deadline, slo, label))
    return reports


def side_by_side(args, targets: list[Target], reports: list[ServeReport]) -> tuple[str, list[dict]]:
    num, den = (1, 0) if args.ratio == "b/a" else (0, 1)
    rlabel = f"{targets[num].name}/{targets[den].name} ({args.ratio})"
    out, rows_json = [], []
    by_level = [{lv.run.max_concurrency: lv for lv in r.levels} for r in reports]
    for level in opt.levels(args):
        if level not in by_level[0] or level not in by_level[1]:
            continue
        sa, sb = by_level[0][level].summary, by_level[1][level].summary
        fa, fb = figures(sa), figures(sb)
        f = (fa, fb)
        ratios = {k: _ratio(f[num][k], f[den][k]) for k in FIGURES}
        rows = [["ok/sent", f"{sa.completed}/{sa.sent}", f"{sb.completed}/{sb.sent}", ""]]
        rows += [[k, _fmt(fa[k]), _fmt(fb[k]), _fmt(ratios[k], 3)] for k in FIGURES if fa[k] is not None or fb[k] is not None]
        out.append(f"max concurrency {level or 'unbounded'}\n"
                   + grid(["figure", targets[0].name + " (a)", targets[1].name + " (b)", rlabel], rows))
        rows_json.append({"max_concurrency": level, "a": fa, "b": fb, "ratio": args.ratio, "ratios": ratios})
    return "\n\n".join(out), rows_json


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    try:
        targets = [parse_target(args.a, "a"), parse_target(args.b, "b")]
        if targets[0].name == targets[1].name:
            targets[1] = Target(targets[1].url, targets[1].model, targets[1].name + "-b")
        slo = parse_goodput(args.goodput)
        workload = opt.build_workload(args)
    except (ValueError, AssertionError, OSError, KeyError) as e:
        print(f"kvmesh bench compare: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    reports = asyncio.run(_run(args, targets, workload, slo))
    for t, r in zip(targets, reports):
        print(f"{t.name}: {r.target['url']} model {t.model}; EOS: {r.eos['mode']} ({r.eos['note']})")
        for lv in r.levels:
            if lv.summary.failed or lv.summary.short_outputs:
                print(level_table(f"{t.name} max concurrency {lv.run.max_concurrency or 'unbounded'}", lv.summary, lv.spec))
    table, rows = side_by_side(args, targets, reports)
    print(table)
    if args.json:
        doc = {"schema": SCHEMA, "names": {"a": targets[0].name, "b": targets[1].name}, "ratio": args.ratio,
               "levels": rows, "a": reports[0].to_json(args.keep_text), "b": reports[1].to_json(args.keep_text)}
        print(f"json: {write_json(doc, args.json)}")
    if args.plot:
        for path in write_plots([series(t.name, r.levels) for t, r in zip(targets, reports)], args.plot):
            print(f"plot: {path}")
    ok = any(lv.summary.completed for r in reports for lv in r.levels)
    return EXIT_OK if ok else EXIT_ALL_FAILED
