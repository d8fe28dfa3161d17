"""Command-line flags shared by `bench serve` and `bench compare`, and what they build."""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from . import datasets as ds
from .load import LoadConfig
from .payload import Endpoint, EosMode

EOS_CHOICES = ["auto"] + [m.value for m in EosMode]


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=["completions", "chat", "embeddings"], default="completions",
                   help="/v1/completions or /v1/chat/completions; embeddings: /v1/embeddings against the model in "
                        "process (sentence-transformers and transformers; needs --reference-model)")
    g.add_argument("--no-stream", dest="stream", action="store_false", help="plain JSON responses (TTFT = E2E)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--eos-mode", choices=EOS_CHOICES, default="auto",
                   help="how to force output lengths: auto probes ignore_eos, then transformers' generation_config")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn", "jsonl"], default="random")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per level (multi-turn: turns in total)")
    g.add_argument("--input-len", default="256", help="tokens: N (with --range-ratio) or LO:HI")
    g.add_argument("--output-len", default="128", help="tokens: N (with --range-ratio) or LO:HI")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [N(1-r), N(1+r)]")
    g.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                   help="random text, or random token ids sent as a list (completions servers that take ids)")
    g.add_argument("--vocab-size", type=int, help="range of random token ids (default: the tokenizer's)")
    g.add_argument("--tokenizer", help="tokenizer.json (or its folder) to make text of exact token lengths")
    g.add_argument("--prefix-groups", type=int, default=8, help="shared-prefix: number of distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: per-request suffix tokens")
    g.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    g.add_argument("--jsonl", help='jsonl: file of {"prompt": ..., "output_len": ...} lines')
    g.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals all derive from it")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    g.add_argument("--sweep-concurrency", help="comma list, e.g. 1,4,16,64: repeat the run per level")
    g.add_argument("--fresh-prompts-per-level", action="store_true",
                   help="level i of a sweep uses --seed + i, so a server's prefix cache cannot answer a level "
                        "with the prompts of the one before (both targets of compare still get the same prompts)")
    g.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests before each level")
    g.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole command; then it stops")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--http-client", choices=["httpx", "lean"], default="httpx",
                   help="lean: a minimal streaming HTTP/1.1 client (loadtest/lean_http.py, plain http:// only) that "
                        "costs ~10x less CPU per token than httpx, for thousands of streams on one machine")
    g.add_argument("--retries", type=int, default=0, metavar="N",
                   help="send a refused request (429, or 503 with Retry-After) again up to N times, after the "
                        "server's Retry-After plus up to 25%% jitter (none given: exponential backoff); default 0: "
                        "a refusal is a failed request")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--metrics-settle", type=float, default=1.5,
                   help="seconds to wait before reading the server's spec_decode counters from /metrics, only when "
                        "it exports them: kvmesh's gateway learns them from workers' load beats (1 s apart), so a "
                        "read right after the last request can miss that request's drafts")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write summary + every request's raw timings here")
    g.add_argument("--plot", help="write PNG plots into this folder")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (e2el too)")
    g.add_argument("--keep-text", action="store_true", help="keep generated text in the JSON")


def levels(args: argparse.Namespace) -> list[int | None]:
    if args.sweep_concurrency:
        return [int(x) for x in str(args.sweep_concurrency).split(",") if x.strip()]
    return [args.max_concurrency]


def _tokenizer(path: str | None):
    if not path:
        return None
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def build_workload(args: argparse.Namespace) -> ds.Workload:
    tok = _tokenizer(args.tokenizer)
    maker = ds.PromptMaker(args.prompt_kind, ds.id_pool(args.vocab_size, tok), tok)
    out_len = ds.parse_len(args.output_len, args.range_ratio)
    if args.dataset == "jsonl":
        assert args.jsonl, "--dataset jsonl needs --jsonl PATH"
        return ds.jsonl_dataset(args.jsonl, args.num_prompts, out_len[1])
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_dataset(maker, args.num_prompts, args.prefix_groups, args.prefix_len,
                                        args.suffix_len, out_len, args.seed)
    in_len = ds.parse_len(args.input_len, args.range_ratio)
    if args.dataset == "multi-turn":
        return ds.multi_turn_dataset(maker, max(1, args.num_prompts // args.turns), args.turns, in_len, out_len, args.seed)
    return ds.random_dataset(maker, args.num_prompts, in_len, out_len, args.seed)


def workload_for_level(args: argparse.Namespace, base: ds.Workload, index: int) -> ds.Workload:
    """The prompts of sweep level `index`: the base workload, or fresh ones with --fresh-prompts-per-level."""
    if not getattr(args, "fresh_prompts_per_level", False) or index == 0:
        return base
    return build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + index}))


def build_endpoint(args: argparse.Namespace, base_url: str, model: str) -> Endpoint:
    return Endpoint(base_url, model, chat=args.endpoint == "chat", stream=args.stream, api_key=args.api_key,
                    temperature=args.temperature, extra_body=dict(args.extra_body))


def build_load(args: argparse.Namespace, max_concurrency: int | None) -> LoadConfig:
    return LoadConfig(args.request_rate, args.burstiness, max_concurrency, args.num_warmups, args.seed,
                      args.request_timeout, args.progress, args.retries, getattr(args, "http_client", "httpx"))


def describe_target(ep: Endpoint) -> dict:
    return {"base_url": ep.base_url, "model": ep.model, "url": ep.url, "chat": ep.chat, "stream": ep.stream,
            "temperature": ep.temperature, "api_key_set": bool(ep.api_key), "extra_body": ep.extra_body}


def describe_workload(w: ds.Workload, args: argparse.Namespace) -> dict:
    return {"dataset": w.name, "num_requests": w.num_requests, "jobs": len(w.jobs), "seed": args.seed,
            "prompt_kind": args.prompt_kind, "meta": w.meta}


def describe_load(args: argparse.Namespace) -> dict:
    return {"request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness, "levels": levels(args), "num_warmups": args.num_warmups,
            "time_limit_s": args.time_limit, "request_timeout_s": args.request_timeout,
            "metrics_settle_s": args.metrics_settle}
