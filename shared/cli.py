"""The one `kvmesh` command. Each subcommand lives in its own module with add_arguments/run."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Modules are imported lazily so `kvmesh --help` stays fast.
COMMANDS = {
    "demo-model": ("shared.models.demo", "write the demo model: SmolLM2-135M-Instruct, or --random for tiny random weights"),
    "generate": ("shared.engine.interactive", "offline interactive generation with the engine"),
    "up": ("shared.launcher.up", "run the whole mesh (nats-server + every service) as local processes"),
    "serve": ("shared.launcher.serve", "run one service in the foreground: kvmesh serve <service> [flags]"),
}
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
    "serve": ("loadtest.serve.cli", "serving benchmark against any OpenAI-compatible server"),
    "compare": ("loadtest.serve.compare", "same workload against two servers, side by side"),
    "baseline": ("loadtest.serve.baseline", "start `transformers serve --continuous-batching` on a model dir"),
    "llamacpp": ("loadtest.serve.llamacpp", "start llama.cpp's llama-server on a GGUF file (--build builds it)"),
}


def _add(sub, name: str, module: str, help_: str) -> None:
    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_, description=help_)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    which = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_) in BENCH.items():
        if wanted == "bench" and which in (None, name, "-h", "--help"):
            _add(bsub, name, module, help_)
        else:
            bsub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
