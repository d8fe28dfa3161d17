"""The `kvmesh` console entry: the mesh's commands (shared/cli.py) plus `kvmesh bench ...`.

It lives here, at the top of the import graph, because the benchmarks import the mesh and never the other
way round: shared/ and services/ know nothing of loadtest/.
"""
from __future__ import annotations

import argparse
import sys

from shared import cli

# name -> (module, help). Modules are imported lazily so `kvmesh --help` stays fast.
BENCH = {
    "offline": ("loadtest.offline", "engine throughput vs transformers, same process"),
    "prefix": ("loadtest.prefix", "time to first token, cold vs prefix-cache warm"),
    "decode": ("loadtest.decode_bench", "ms per decode step by batch size, GPU-busy share, decode attention bandwidth"),
    "kv-transfer": ("loadtest.kv_transfer", "KV transfer over NATS, TCP and shared memory, and TTFT local vs remote vs kvstore"),
    "tiers": ("loadtest.tiers", "TTFT of a long prompt whose prefix is in device / host / kvstore / disk / nowhere"),
    "disk-layout": ("loadtest.disk_layout", "the kvstore disk tier's layouts: slab file vs file per block vs per group"),
    "sim-profile": ("loadtest.sim_profile", "fit the simulated engine's cost model (--engine sim) to this machine's real steps"),
    "planner": ("loadtest.planner_bench", "the planner vs fixed prefill:decode splits on a shifting workload (simulated workers)"),
    "scale": ("loadtest.scale_bench", "a 64 decode + 16 prefill simulated mesh under streaming load: throughput, NATS, CPU, mesh overhead, prefix routing"),
    "spec": ("loadtest.spec_bench", "speculative decoding off vs ngram vs suffix on SmolLM2: tok/s, ITL, acceptance length"),
    "spec-shared": ("loadtest.spec_shared_suffix", "suffix speculation on 2+ real decode workers, sharing outputs off vs on: acceptance"),
    "overload": ("loadtest.overload_bench", "kvmesh up --prefill 1 --decode 2 on SmolLM2 past its capacity: cancels, a killed worker, what is left"),
    "serve": ("loadtest.serve.cli", "serving benchmark against any OpenAI-compatible server"),
    "compare": ("loadtest.serve.compare", "same workload against two servers, side by side"),
    "baseline": ("loadtest.serve.baseline", "start `transformers serve --continuous-batching` on a model dir"),
    "llamacpp": ("loadtest.serve.llamacpp", "start llama.cpp's llama-server on a GGUF file (--build builds it)"),
}
GROUPS = {"bench": ("benchmarks", BENCH)}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every `kvmesh` command: the mesh's and the benchmarks'."""
    return cli.build_parser(argv, GROUPS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(build_parser(argv).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
