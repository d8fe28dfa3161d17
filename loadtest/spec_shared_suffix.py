"""Shared suffix decoding A/B: does learning the other decode workers' finished outputs raise acceptance?

Real services on a real nats-server: `--workers` decode workers with suffix speculation (real SmolLM2 by
default), requests sent straight to each worker's subject, round robin, in lock-step rounds (each worker one
request at a time; after a round every shared output has reached the other workers before the next starts), so
both arms see the same requests in the same places and the same order, once with sharing off and once on, each
arm on fresh workers. Workloads where the same kind of answer recurs on different workers: (a) grounded, bench
spec's four input-grounded templates over several documents; (b) chat, bench spec's four questions, each asked
in several phrasings; (c) email, the same short email for six people (`--workloads grounded,chat,email`). Reported per workload and arm: drafts, draft tokens, accepted tokens, mean acceptance
length (1 + accepted / drafts), output tokens per verify-or-decode step (output tokens / engine steps that
emitted for a request), whether the outputs equal the other arm's (greedy), and wall seconds (noise here).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loadtest.spec_bench import WORKLOADS as SPEC_WORKLOADS

DOCS = [
    ("The town council met on Tuesday evening to review the budget for next year. The council agreed that the "
     "budget for the public library would rise by ten percent, so that the library can stay open on Sundays. The "
     "budget for the park on Main Street will stay the same. The next meeting will be held on the first Monday of "
     "March, in the library's reading room."),
    ("The school board met on Thursday morning to discuss the new term. The board agreed that the budget for the "
     "science lab would rise by five percent, so that the lab can buy new microscopes. The budget for the sports "
     "field will fall by two percent. The next meeting will be held on the second Friday of April, in the school "
     "hall."),
    ("The hospital committee met on Monday afternoon to plan the winter season. The committee agreed that the "
     "budget for the children's ward would rise by eight percent, so that the ward can hire two more nurses. The "
     "budget for the car park will stay the same. The next meeting will be held on the last Wednesday of January, "
     "in the east wing."),
]
CHAT_PHRASINGS = [
    ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
     "Tell me a short story: a lighthouse keeper discovers a message in a bottle.",
     "Please write a brief tale about a lighthouse keeper finding a bottle with a message inside."],
    ["What are three good habits for staying healthy? Explain each briefly.",
     "Name three healthy habits and explain each one briefly.",
     "Give me three good habits for a healthy life, with a short explanation of each."],
    ["Explain how a rainbow forms, for a ten-year-old.",
     "How does a rainbow form? Explain it to a ten-year-old.",
     "Can you explain to a ten year old child how rainbows are made?"],
    ["Give me some ideas for a weekend trip in the mountains.",
     "What could I do on a weekend trip to the mountains? Some ideas please.",
     "Suggest a few ideas for a mountain weekend getaway."],
]
# (c) formulaic answers: the same kind of message for different people, as a support or office assistant writes.
EMAILS = [("Anna", "Monday"), ("Ben", "Tuesday"), ("Carla", "Wednesday"), ("David", "Thursday"), ("Emma", "Friday"),
          ("Frank", "Saturday")]
SPEC = '{"method": "suffix", "num_speculative_tokens": 6}'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--workloads", default="grounded,chat,email")
    p.add_argument("--json", default="loadtest/results/spec_shared_suffix_cpu.json", metavar="PATH")


def prompts(tok, workload: str) -> list[list[int]]:  # noqa: ANN001
    """Requests in sending order: variants of one kind are adjacent, so round robin puts them on different
    workers (what a load-balancing router does to requests without a shared prefix)."""
    from shared.models.tokenizer import encode_chat

    if workload == "grounded":
        texts = [t.format(doc=d) for t in SPEC_WORKLOADS["grounded"] for d in DOCS]
    elif workload == "email":
        texts = [f"Write a short, polite email to {name} declining the meeting on {day}." for name, day in EMAILS]
    else:
        texts = [q for phrasings in CHAT_PHRASINGS for q in phrasings]
    return [encode_chat(tok, [{"role": "user", "content": t}]) for t in texts]


async def run_arm(model: str, args: argparse.Namespace, share: bool, workloads: dict[str, list[list[int]]]) -> dict:
    from services.decode.service import DecodeService, DecodeSettings
    from shared import bus, subjects
    from shared.bus.natsd import NatsServer
    from shared.config import EngineConfig
    from shared.protocol.generate import GenerateRequest, TokenChunk
    from shared.sampling_params import SamplingParams
    from shared.spec_config import SpeculativeConfig

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-shared-suffix-") as tmp, NatsServer(workdir=tmp) as nats:
        ids = [f"d{i}" for i in range(args.workers)]
        workers, conns = [], []
        for wid in ids:
            cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype,
                               speculative_config=SpeculativeConfig.parse(SPEC))
            w = DecodeService(cfg, DecodeSettings(wid, remote_prefill_threshold=1 << 30, use_kvstore=False,
                                                  share_suffix_outputs=share))
            conns.append(await bus.connect(nats.url))
            await w.start(conns[-1])
            workers.append(w)
        client = await bus.connect(nats.url)

        async def generate(wid: str, prompt: list[int]) -> tuple[list[int], int]:
            req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=params)
            tokens, chunks = [], 0
            async with await bus.request_stream(client, subjects.decode_generate(wid), req, timeout=600,
                                                expect=TokenChunk) as stream:
                async for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    chunks += 1  # one chunk per engine step that emitted for the request
            return tokens, chunks

        async def shared_everything() -> None:
            """Until every worker learned every output the others published (sharing arm only)."""
            if not share:
                return
            for _ in range(200):
                if all(w.suffix_sharing.learned == sum(o.suffix_sharing.published for o in workers if o is not w)
                       for w in workers):
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("shared outputs did not arrive")

        async def spec_counts() -> list[tuple[int, int, int]]:
            return [await w.thread.call(lambda e: (e.speculator.stats.num_drafts, e.speculator.stats.num_draft_tokens,
                                                   e.speculator.stats.num_accepted_tokens)) for w in workers]

        for name, ps in workloads.items():
            before = await spec_counts()
            t0 = time.perf_counter()
            outputs, steps = [], 0
            for at in range(0, len(ps), len(ids)):
                rnd = await asyncio.gather(*(generate(wid, p) for wid, p in zip(ids, ps[at : at + len(ids)])))
                outputs += [t for t, _ in rnd]
                steps += sum(c for _, c in rnd)
                await shared_everything()
            wall = time.perf_counter() - t0
            after = await spec_counts()
            drafts, draft_tokens, accepted = (sum(a[i] - b[i] for a, b in zip(after, before)) for i in range(3))
            n_out = sum(len(t) for t in outputs)
            out[name] = {"requests": len(ps), "output_tokens": n_out, "steps_with_output": steps,
                         "tokens_per_step": round(n_out / max(steps, 1), 3), "num_drafts": drafts,
                         "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                         "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                         "draft_acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
                         "wall_s": round(wall, 1), "outputs": outputs}
            print(f"share={share!s:5s} {name:8s} acceptance length {out[name]['mean_acceptance_length']} "
                  f"tokens/step {out[name]['tokens_per_step']} drafts {drafts} accepted {accepted} "
                  f"({wall:.0f} s)", file=sys.stderr, flush=True)
        out["shared_outputs_learned"] = [w.suffix_sharing.learned if w.suffix_sharing else 0 for w in workers]
        for w in workers:
            await w.drain(2.0)
        for c in [*conns, client]:
            await c.close()
    return out


def run(args: argparse.Namespace) -> int:
    from loadtest.workload import machine_info, warn_if_busy
    from shared.models.model_source import resolve_model
    from shared.models.smollm2 import smollm2_checkpoint
    from shared.models.tokenizer import load_tokenizer

    model = resolve_model(args.model) if args.model else str(smollm2_checkpoint())
    machine = machine_info(args.device)
    warn_if_busy()
    tok = load_tokenizer(model)
    workloads = {w: prompts(tok, w) for w in args.workloads.split(",")}
    arms = {"off": asyncio.run(run_arm(model, args, False, workloads)),
            "shared": asyncio.run(run_arm(model, args, True, workloads))}
    summary = {}
    for w in workloads:
        off, on = arms["off"][w], arms["shared"][w]
        summary[w] = {"acceptance_length_off": off["mean_acceptance_length"],
                      "acceptance_length_shared": on["mean_acceptance_length"],
                      "tokens_per_step_off": off["tokens_per_step"], "tokens_per_step_shared": on["tokens_per_step"],
                      "same_outputs": off["outputs"] == on["outputs"]}
    for arm in arms.values():
        for w in workloads:
            arm[w].pop("outputs")
    report = {"bench": "spec_shared_suffix", "model": Path(model).name, "device": args.device, "dtype": args.dtype,
              "workers": args.workers, "max_tokens": args.max_tokens, "speculative_config": SPEC,
              "machine": machine, "summary": summary, "arms": arms}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
