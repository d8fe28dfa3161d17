"""The five things a GPU check run reports, read from its step files (DIR/<step>.json, or the cases a cut step
appended to DIR/<step>.jsonl): kernels against their twins, greedy exactness, graphs captured and replayed, the
memory plan against what the allocator reserved, and speed against the targets."""
from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

from loadtest.gpu_check_steps import kernel_table, read_cases

# What the engine should reach on an H100/H200 (the check reports them; it does not fail on them).
TARGETS = {"offline_tok_s_min": 6000.0, "decode_b1_ms_max": 2.5, "decode_attention_fraction_of_copy_min": 0.6}
GIB = 2**30


def _load(out: Path, step: str) -> dict:
    path = out / f"{step}.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return {}


def _bench_result(out: Path, step: str) -> dict:
    data = _load(out, step)
    if data.get("result"):
        return data["result"]
    cases = [c for c in read_cases(out, step) if c.get("result")]
    return cases[-1]["result"] if cases else {}


def kernels(out: Path) -> dict:
    data = _load(out, "kernels")
    cases = [c for c in read_cases(out, "kernels") if "kernel" in c]
    return {"cases": len(cases), "planned": data.get("cases_planned"), "failed": sum(not c["ok"] for c in cases),
            "by_kernel": kernel_table(cases), "variants_compiled": data.get("variants_compiled"),
            "compile_s_total": round(sum(c.get("compile_s", 0.0) for c in cases), 1),
            "wall_s": data.get("seconds"), "shards": data.get("shards")}


def greedy(out: Path) -> dict:
    cases = {c["case"]: c for c in read_cases(out, "greedy")}
    graphs = {c["case"]: c for c in read_cases(out, "graphs") if "identical" in c}
    res = {name: (f"{c['identical']}/{c['prompts']} identical ({c.get('dtype')})" if "identical" in c
                  else c.get("skipped", c.get("error", "?"))) for name, c in cases.items()}
    res["graphs_vs_eager"] = {k: f"{c['identical']}/{c['of']}" for k, c in graphs.items()}
    if "smollm2" in cases:
        res["smollm2_texts"] = cases["smollm2"].get("texts")
    return res


def graphs(out: Path) -> dict:
    capture = {c["case"]: {k: c.get(k) for k in ("buckets", "pool_mib", "reserve_estimate_mib", "ready_s")}
               for c in read_cases(out, "graphs") if c.get("case", "").startswith("capture")}
    spec = _load(out, "spec")
    budget = next((c for c in read_cases(out, "spec") if c.get("case", "").startswith("draft engine")), {})
    return {"decode": capture,
            "verify_graphs": [line for line in budget.get("engine_log", []) if "verify" in line],
            "verify_steps": spec.get("verify_steps") or budget.get("verify_steps"),
            "speculative_identical_to_off": spec.get("identical_to_off"),
            "draft_decode_graphs": budget.get("draft_decode_graphs")}


def _plan(status: dict) -> dict:
    keep = ("budget", "peak_reserved", "peak_allocated", "spare", "num_blocks", "time_to_ready_s", "ok", "error")
    row = {k: status[k] for k in keep if k in status}
    row["plan"] = [line for line in status.get("engine_log", []) if line.startswith("memory")]
    if "budget" in status and "peak_reserved" in status:
        row["reserved_of_budget"] = round(status["peak_reserved"] / status["budget"], 3)
    return row


def memory(out: Path) -> dict:
    workers = [c for c in read_cases(out, "two-workers") if c.get("case", "").startswith("worker")]
    budget = next((c for c in read_cases(out, "spec") if c.get("case", "").startswith("draft engine")), {})
    return {"two_workers_at_0.4": [_plan(w) for w in workers], "draft_engine_at_0.5": _plan(budget)}


def speed(out: Path) -> dict:
    decode = _bench_result(out, "decode")
    rows = {str(r["batch"]): {k: r.get(k) for k in ("ms_per_step", "tok_s", "gpu_busy_share", "device_events_per_step")}
            for r in decode.get("steps", []) if "ms_per_step" in r}
    attn = decode.get("decode_attention") or {}
    offline = _bench_result(out, "offline")
    tiles = _load(out, "kernels").get("prefill_tiles") or {}
    ready = {}
    smol = next((c for c in read_cases(out, "greedy") if c.get("case") == "smollm2"), {})
    if "time_to_ready_s" in smol:
        ready["smollm2-135m bf16"] = smol["time_to_ready_s"]
    for c in read_cases(out, "two-workers"):
        if "time_to_ready_s" in c:
            ready[f"qwen3-0.6b {c['case']}"] = c["time_to_ready_s"]
    fraction = attn.get("fraction_of_copy") if isinstance(attn, dict) else None
    b1 = rows.get("1", {}).get("ms_per_step")
    tok_s = offline.get("kvmesh_tok_s")
    return {"decode_qwen3_0.6b": rows, "decode_attention_fraction_of_copy": fraction,
            "prefill_paged_vs_sdpa": {k: v.get("paged_vs_sdpa") for k, v in tiles.items() if isinstance(v, dict)},
            "offline_nano_vllm": {"kvmesh_tok_s": tok_s, "hf_batched_tok_s": offline.get("hf_batched_tok_s"),
                                  "ratio": offline.get("ratio_vs_hf_batched")},
            "time_to_ready_s": ready,
            "targets": {"offline_tok_s >= 6000": None if tok_s is None else tok_s >= TARGETS["offline_tok_s_min"],
                        "decode_b1_ms <= 2.5": None if b1 is None else b1 <= TARGETS["decode_b1_ms_max"],
                        "decode_attention >= 0.6 of a copy": None if fraction is None else
                        fraction >= TARGETS["decode_attention_fraction_of_copy_min"]}}


SECTIONS: dict[str, Callable[[Path], dict]] = {"kernels": kernels, "greedy": greedy, "graphs": graphs,
                                               "memory": memory, "speed": speed}


def five_things(out: Path) -> dict:
    """Every section on its own: one that cannot be read says why and the others stand."""
    report = {}
    for name, fn in SECTIONS.items():
        try:
            report[name] = fn(out)
        except Exception as e:  # noqa: BLE001 - a summary must always be written
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-1500:]}
    return report
