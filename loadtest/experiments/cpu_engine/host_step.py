"""`python -m loadtest.experiments.cpu_engine.host_step`: the host's work per decode step, with the model's forward taken out.

On a GPU the forward of a decode step at batch 128 takes a few milliseconds; whatever the host spends around
it (scheduling, building the step's inputs and block tables, sampling bookkeeping, appending tokens and
building outputs) adds to it unless it overlaps. Here the model is a stub that returns zeros, so what is
timed is the host's share alone: `batch` requests at `context` tokens, `steps` decode steps, ms per step in
total and per phase.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--contexts", default="1024,4096", help="comma list of context lengths")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eager", action="store_true", help="the eager path (CUDA takes the graph path for decode steps)")
    p.add_argument("--json", metavar="PATH")


def _timed(obj, name: str, times: dict) -> None:
    real = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            times[name] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def measure(model_dir: str, batch: int, context: int, steps: int, graphs: bool) -> dict:
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    # Requests admitted first decode while later prompts prefill: room for that, and none finishes while timed.
    max_len = context + context * batch // 2048 + steps + 64
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", max_num_seqs=batch,
                                    max_num_batched_tokens=max(2048, batch), max_model_len=max_len,
                                    num_kv_blocks=batch * (max_len // 16 + 2)))
    hidden, vocab = engine.model_config.hidden_size, engine.model_config.vocab_size
    # The stub forward: zeros of the right shapes, no compute.
    engine.model.forward = lambda ids, positions, meta, kv: torch.zeros(ids.shape[0], hidden)
    engine.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    if graphs:  # the decode-graph path's host side (static buffers), its replay being the stub forward
        engine.runner.use_decode_graphs(max_len, batch, capture=False)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(0, vocab - 1, (context,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.requests.values()):
        engine.step()
    times: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", times)
    _timed(engine.runner, "build", times)
    _timed(engine.sampler, "sample", times)
    if engine.runner.graphs is not None:
        _timed(engine.runner.graphs, "run", times)
    start = time.perf_counter()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch, (len(outs), engine.stats())
    total = time.perf_counter() - start
    ms = {k: round(1000 * v / steps, 3) for k, v in times.items()}
    ms["rest (append, outputs, caching)"] = round(1000 * total / steps - sum(ms.values()), 3)
    return {"path": "graphs" if graphs else "eager", "batch": batch, "context": context, "steps": steps, "ms_per_step": round(1000 * total / steps, 3),
            "phases_ms": ms}


def run(args: argparse.Namespace) -> int:
    from tests.checkpoints import build_checkpoint

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint("qwen3", Path(tmp) / "qwen3", max_position_embeddings=8192)
        for context in [int(c) for c in args.contexts.split(",")]:
            r = measure(str(ckpt.path), args.batch, context, args.steps, graphs=not args.eager)
            results.append(r)
            print(f"{r['path']} batch {r['batch']} context {r['context']}: {r['ms_per_step']:.2f} ms host per decode step "
                  f"{r['phases_ms']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch_threads": torch.get_num_threads(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m loadtest.experiments.cpu_engine.host_step", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
