"""`kvmesh bench spec`: speculative decoding off vs each method, on the real SmolLM2 model, in one run.

For each method (off, ngram, suffix) one engine in this process; for each workload ((a) input-grounded: repeat,
rewrite or quote text given in the prompt, fill a JSON template; (b) open-ended chat) and each concurrency, a
closed loop keeps exactly `concurrency` requests in flight until `requests` have finished. Greedy, so every
method has the same work to do. Reported per cell: output tokens/s (output tokens / wall seconds), mean
inter-token latency (a request's decode seconds / its tokens after the first, averaged over requests), mean
acceptance length (tokens a verify gives a request: 1 + accepted / drafts), each method's ratio to off, how many
requests' greedy outputs are identical to off's, and the verify steps by path (CUDA graph replays, the padded
bucket path run eagerly, eager). --synthetic-prompts serves a checkpoint without a tokenizer (the random-weight
shapes of loadtest/shapes.py, as `python -m loadtest.gpu_check`'s spec step does).

draft_model drafts with --draft-model (a checkpoint with the target's tokenizer); by default, for SmolLM2, its own
first --draft-layers layers cut into a checkpoint of their own (loadtest/draft_checkpoint.py): no smaller model
shares SmolLM2's tokenizer here. The same bench runs on a GPU: --device cuda --model a Qwen3 checkpoint
--draft-model a smaller Qwen3 of the same tokenizer (e.g. Qwen3-8B drafted by Qwen3-0.6B).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WORKLOADS = {
    "grounded": [
        ("Repeat this paragraph exactly, word for word:\n\n{doc}"),
        ("Rewrite this text with every sentence on its own line, changing nothing else:\n\n{doc}"),
        ("Quote the two sentences of this document that mention the library, exactly as written:\n\n{doc}"),
        ('Fill in this JSON template from the text, copying the values exactly: {{"meeting_day": "", '
         '"library_budget_change": "", "park_budget_change": "", "next_meeting": ""}}\n\nText: {doc}'),
    ],
    "chat": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Explain how a rainbow forms, for a ten-year-old.",
        "Give me some ideas for a weekend trip in the mountains.",
    ],
}
DOC = ("The town council met on Tuesday evening to review the budget for next year. The council agreed that the "
       "budget for the public library would rise by ten percent, so that the library can stay open on Sundays. "
       "The budget for the park on Main Street will stay the same as this year. The council also voted to repair "
       "the bridge over the river before the winter. The next meeting of the council will be held on the first "
       "Monday of March, in the library's reading room.")
METHODS = {"off": None, "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                 '"prompt_lookup_max": 4}',
           "suffix": '{"method": "suffix", "num_speculative_tokens": 6}',
           "draft_model": '{"method": "draft_model", "num_speculative_tokens": 4, "model": "(--draft-model)"}'}
DEFAULT_METHODS = ("off", "ngram", "suffix")  # draft_model on request: it needs a draft checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list out of {','.join(METHODS)}")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="draft_model's checkpoint (default: the target's first --draft-layers layers)")
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the default cut draft (default 6)")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of requests kept in flight")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per cell (default: max(2, concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="override the methods' disable_by_batch_size (the adaptive rule's batch threshold)")
    p.add_argument("--synthetic-prompts", action="store_true",
                   help="token-id prompts instead of text (a checkpoint without a tokenizer: the random-weight shapes "
                        "of loadtest/shapes.py): (a) a random document repeated in part, (b) random chat-length ids")
    p.add_argument("--padded-verify", action="store_true",
                   help="off CUDA, verify steps through the padded bucket path that CUDA captures as graphs, run "
                        "eagerly (on CUDA the engine captures them unless --enforce-eager)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="each engine's KV pool in bytes (default: the CPU default; on CUDA 2 GiB each: the methods' "
                        "engines share this process, whose allocator the GPU memory budget would count once per engine)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--json", default="loadtest/results/spec_cpu.json", metavar="PATH")


def _prompts(tok, workload: str) -> list[list[int]]:  # noqa: ANN001
    from shared.models.tokenizer import encode_chat

    return [encode_chat(tok, [{"role": "user", "content": t.format(doc=DOC)}]) for t in WORKLOADS[workload]]


def synthetic_prompts(vocab: int, workload: str, n: int = 4) -> list[list[int]]:
    """Token ids for a model without a tokenizer: grounded = a 96-token random document followed by parts of it
    (what a lookup proposer can draft from), chat = 40 random ids. Ids 0-9 are left out (special tokens)."""
    import torch

    g = torch.Generator().manual_seed(7 if workload == "grounded" else 8)
    out = []
    for i in range(n):
        if workload == "grounded":
            doc = torch.randint(10, vocab, (96,), generator=g).tolist()
            out.append(doc + doc[: 24 + 8 * i])
        else:
            out.append(torch.randint(10, vocab, (40,), generator=g).tolist())
    return out


def run_cell(engine, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int) -> dict:  # noqa: ANN001
    from shared.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec0 = _spec_counts(engine)
    verify0 = dict(engine.runner.verify_stats.__dict__)
    outputs: dict[str, list[int]] = {}
    submitted = finished = 0
    first: dict[str, float] = {}
    start: dict[str, float] = {}
    itls: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    while finished < n:
        while submitted < n and submitted - finished < concurrency:
            rid = f"r{submitted}"
            engine.add_request(rid, prompts[submitted % len(prompts)], params)
            start[rid] = time.perf_counter()
            submitted += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                finished += 1
                outputs[out.request_id] = list(out.output_token_ids)
                k = len(out.output_token_ids)
                tokens += k
                if k > 1:
                    itls.append((now - first[out.request_id]) / (k - 1))
    wall = time.perf_counter() - t0
    spec1 = _spec_counts(engine)
    drafts = spec1[0] - spec0[0]
    accepted = spec1[1] - spec0[1]
    return {"requests": n, "output_tokens": tokens, "seconds": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2), "mean_itl_ms": round(1000 * sum(itls) / max(len(itls), 1), 2),
            "drafts": drafts, "draft_tokens": spec1[2] - spec0[2], "accepted_tokens": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            # Verify steps: replayed from a CUDA graph, through the padded bucket path eagerly, or eager.
            "verify_steps": {k: v - verify0[k] for k, v in engine.runner.verify_stats.__dict__.items()},
            "outputs": [outputs[f"r{i}"] for i in range(n)]}  # dropped from the report (identical_to_off keeps)


def _spec_counts(engine) -> tuple[int, int, int]:  # noqa: ANN001
    s = engine.speculator
    return (0, 0, 0) if s is None else (s.stats.num_drafts, s.stats.num_accepted_tokens, s.stats.num_draft_tokens)


def run(args: argparse.Namespace) -> int:
    from loadtest.workload import machine_info, warn_if_busy
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.model_source import resolve_model
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import load_tokenizer
    from shared.spec_config import SpeculativeConfig

    model = resolve_model(args.model) if args.model else str(smollm2_checkpoint())
    # "off" first: every other method's outputs are compared with its (identical_to_off).
    methods = sorted((m.strip() for m in args.methods.split(",") if m.strip()), key=lambda m: m != "off")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    machine = machine_info(args.device)
    warn_if_busy()
    if args.synthetic_prompts:
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompts = {w: synthetic_prompts(vocab, w) for w in WORKLOADS}
    else:
        try:
            tok = load_tokenizer(model)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{model}: no tokenizer ({e}); pass --synthetic-prompts for a random-weight shape")
        prompts = {w: _prompts(tok, w) for w in WORKLOADS}
    results: dict[str, dict] = {}
    # Every method's engine at once, and the methods run back to back within each cell: load from other work on
    # the machine drifts over minutes, and interleaving keeps each ratio's two runs close in time.
    engines = {}
    graphs: dict[str, dict | None] = {}  # each method's verify graphs: how many, captured bytes vs the estimate
    texts = dict(METHODS)
    if "draft_model" in methods:
        texts["draft_model"] = json.dumps({**json.loads(METHODS["draft_model"]), "model": _draft_dir(args, model)})
    for method in methods:
        spec = SpeculativeConfig.parse(texts[method])
        if spec is not None and args.disable_by_batch_size is not None:
            spec = SpeculativeConfig(**{**json.loads(spec.to_json()), "disable_by_batch_size": args.disable_by_batch_size})
        kv_bytes = args.kv_cache_bytes or (2 << 30 if args.device.startswith("cuda") else None)
        engines[method] = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype,
                                                 speculative_config=spec, max_num_seqs=max(levels),
                                                 kv_cache_bytes=kv_bytes, max_model_len=args.max_model_len))
        if args.padded_verify:
            _padded_verify(engines[method])
        graphs[method] = _verify_graphs(engines[method])
        engines[method].generate([prompts["chat"][0]], _warm(args.max_tokens), use_tqdm=False)  # off the clock
    for workload, ps in prompts.items():
        for c in levels:
            n = args.requests or max(2, c)
            want = None
            for method, engine in engines.items():
                cell = run_cell(engine, ps, c, n, args.max_tokens)
                got = cell.pop("outputs")
                want = got if want is None else want  # the first method's (off, when run)
                cell["identical_to_off"] = f"{sum(a == b for a, b in zip(got, want))}/{n}" if "off" in engines else None
                results.setdefault(workload, {}).setdefault(str(c), {})[method] = cell
                print(f"{method:11s} {workload:8s} c={c:<3d} {cell['output_tok_s']:8.1f} tok/s  ITL "
                      f"{cell['mean_itl_ms']:7.1f} ms  acceptance length {cell['mean_acceptance_length']}  "
                      f"identical {cell['identical_to_off']}  verify steps {cell['verify_steps']}",
                      file=sys.stderr, flush=True)
                _write(args, model, methods, machine, results, texts, graphs)  # a cell at a time: a cut-short run keeps what it measured
    _write(args, model, methods, machine, results, texts, graphs)
    print(json.dumps(results, indent=1))
    return 0


def _padded_verify(engine) -> None:  # noqa: ANN001
    """Off CUDA: the engine's verify steps through the padded bucket path, eagerly (no-op without speculation, or
    where the engine already captured verify graphs)."""
    from shared.engine.verify_buckets import verify_plan_for

    plan = verify_plan_for(engine.config, engine.max_model_len)
    if plan is not None and engine.runner.verify_graphs is None and engine.tp is None:
        engine.runner.use_verify_graphs(plan, capture=False)


def _verify_graphs(engine) -> dict | None:  # noqa: ANN001
    """The engine's verify graphs: captured (0 on the padded eager path), buckets, and on CUDA the memory the
    capture reserved beside the plan's estimate (shared/engine/verify_buckets.py)."""
    vg = engine.runner.verify_graphs
    if vg is None:
        return None
    dtype_bytes = next(engine.model.parameters()).element_size()
    return {"captured": len(vg.graphs), "shapes": len(vg.plan.shapes), "capture_bytes": vg.capture_bytes,
            "estimate_bytes": vg.plan.memory_bytes(engine.model_config.hidden_size, dtype_bytes)}


def _draft_dir(args: argparse.Namespace, model: str) -> str:
    if args.draft_model:
        from shared.models.model_source import resolve_model

        return str(Path(resolve_model(args.draft_model)).resolve())
    from loadtest.draft_checkpoint import truncated_checkpoint

    dst = Path(model).parent / f"{Path(model).name}-first{args.draft_layers}layers"
    return str(truncated_checkpoint(model, dst, args.draft_layers))


def _write(args: argparse.Namespace, model: str, methods: list[str], machine: dict, results: dict,
           texts: dict[str, str | None], graphs: dict[str, dict | None]) -> None:
    for cells in results.values():
        for by_method in cells.values():
            base = by_method.get("off")
            for m, cell in by_method.items():
                if base and m != "off":
                    cell["tok_s_vs_off"] = round(cell["output_tok_s"] / base["output_tok_s"], 3)
                    cell["itl_vs_off"] = round(cell["mean_itl_ms"] / base["mean_itl_ms"], 3)
    report = {"bench": "spec", "model": Path(model).name, "device": args.device, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "methods": {m: texts[m] for m in methods}, "verify_graphs": graphs,
              "machine": machine,
              "workloads": {w: [t[:60] for t in WORKLOADS[w]] for w in WORKLOADS}, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def _warm(max_tokens: int):  # noqa: ANN202
    from shared.sampling_params import SamplingParams

    return SamplingParams(max_tokens=min(8, max_tokens), temperature=0.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
