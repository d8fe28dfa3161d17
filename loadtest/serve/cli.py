r"""`kvmesh bench serve`: a serving benchmark for any OpenAI-compatible server.

    kvmesh bench serve --base-url http://127.0.0.1:8000 --model MODEL \
        --dataset random --input-len 32:512 --output-len 32:256 --num-prompts 128 \
        --sweep-concurrency 1,4,16,64 --json out.json --plot plots/

Exit codes: 0 the run finished (individual requests may have failed: they are in the report);
1 not one request succeeded (server down, wrong model, every request rejected); 2 bad arguments.
The command always stops by itself: a bounded number of requests and --time-limit for the whole run.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from . import options as opt
from .datasets import Workload
from .metrics import parse_goodput
from .plots import write_plots
from .report import ServeReport, level_table, sweep_table, write_json
from .runner import EXIT_BAD_ARGS, exit_code, measure, prepare, series


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, with or without /v1")
    p.add_argument("--model", required=True,
                   help="model name as the server knows it; a,b,c: requests take the names in turn (e.g. LoRA adapters)")
    opt.add_request_arguments(p)
    opt.add_dataset_arguments(p)
    opt.add_load_arguments(p)
    opt.add_output_arguments(p)
    p.add_argument("--reference-model", default=None, metavar="DIR",
                   help="--endpoint embeddings: the served checkpoint, run in process for the comparison")


async def _run(args: argparse.Namespace, workload: Workload, slo: dict[str, float]) -> ServeReport:
    deadline = time.perf_counter() + args.time_limit
    ep, probe = await prepare(opt.build_endpoint(args, args.base_url, args.model), args, deadline)
    report = ServeReport(opt.describe_target(ep), {"mode": probe.mode.value, "note": probe.note},
                         opt.describe_workload(workload, args), opt.describe_load(args))
    for i, level in enumerate(opt.levels(args)):
        if time.perf_counter() >= deadline:
            report.skipped_levels.append(level)
            continue
        report.levels.append(await measure(ep, opt.workload_for_level(args, workload, i), args, level, deadline, slo,
                                           f"concurrency {level}"))
    return report


def run(args: argparse.Namespace) -> int:
    if args.endpoint == "embeddings":
        from .embeddings import run as run_embeddings

        return run_embeddings(args)
    try:
        slo = parse_goodput(args.goodput)
        workload = opt.build_workload(args)  # bad dataset flags fail before any network traffic
    except (ValueError, AssertionError, OSError, KeyError) as e:
        print(f"kvmesh bench serve: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    report = asyncio.run(_run(args, workload, slo))
    print(f"target {report.target['url']} model {args.model}; EOS: {report.eos['mode']} ({report.eos['note']})")
    for lv in report.levels:
        print(level_table(f"max concurrency {lv.run.max_concurrency or 'unbounded'}", lv.summary, lv.spec))
        if lv.run.hit_time_limit:
            print(f"  stopped by --time-limit {args.time_limit:g}s")
    if len(report.levels) > 1:
        print(sweep_table(report.levels))
    if report.skipped_levels:
        print(f"levels not run (time limit): {report.skipped_levels}")
    if args.json:
        print(f"json: {write_json(report.to_json(args.keep_text), args.json)}")
    if args.plot:
        for path in write_plots([series(args.model, report.levels)], args.plot):
            print(f"plot: {path}")
    return exit_code(report.levels)
