"""Summarize `kvmesh bench serve` runs of the base model alone and of 1, 4, 16 LoRA adapters (`--model a,b,...`:
request i takes adapter i mod n) into one JSON: throughput against the base run, TTFT, and TTFT of the requests
that were the first of their adapter in the run (the adapter had to go into a device slot first, and, with more
adapters than --max-cpu-loras, be read from disk) apart from the others.

    python -m loadtest.experiments.lora.summarize OUT.json base=base.json lora1=lora1.json ...
"""
from __future__ import annotations

import json
import statistics
import sys


def _ms(values: list[float]) -> float | None:
    return round(1000 * statistics.mean(values), 1) if values else None


def summarize(runs: dict[str, dict]) -> dict:
    out: dict = {"runs": {}}
    base_tput = None
    for name, report in runs.items():
        run = report["runs"][0]
        s = run["summary"]
        models = report["target"].get("model", "").split(",")
        reqs = [r for r in run["requests"] if r["ok"]]
        seen: set[str] = set()
        cold, warm = [], []
        for r in sorted(reqs, key=lambda r: r["start"]):
            model = models[r["job"] % len(models)] if models else ""
            (warm if model in seen or name == "base" else cold).append(r["ttft"])
            seen.add(model)
        cached = sum((r.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0 for r in reqs)
        tput = s["output_throughput"]
        if name == "base":
            base_tput = tput
        out["runs"][name] = {
            "adapters": 0 if name == "base" else len(models), "requests": len(reqs),
            "output_tok_s": round(tput, 3), "throughput_vs_base": round(tput / base_tput, 3) if base_tput else None,
            "ttft_mean_ms": round(s["ttft_ms"]["mean"], 1), "ttft_first_of_adapter_ms": _ms(cold),
            "ttft_other_ms": _ms(warm), "prompt_tokens_cached": cached,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in reqs)}
    return out


def main(argv: list[str]) -> None:
    out, pairs = argv[0], [a.split("=", 1) for a in argv[1:]]
    result = summarize({k: json.load(open(v)) for k, v in pairs})
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
