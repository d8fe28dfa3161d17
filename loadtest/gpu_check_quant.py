"""The GPU check's quantized rows: the FP8 and 4-bit GEMM kernels against their torch twins at the linear layers of
Llama-3.1-8B and Qwen3-0.6B (cases of the kernels step), and the `quant` step: `kvmesh bench offline` (tok/s)
and `kvmesh bench decode` (ms/step at batch 1 and 64) in bf16, FP8 and AWQ side by side at those shapes (random
weights; AWQ's rounded to 4 bits at load)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# (hidden, q, kv, intermediate): the linear layers' shapes of the models the check serves.
QUANT_SHAPES = {"qwen3-0.6b": (1024, 2048, 1024, 3072), "llama-3.1-8b": (4096, 4096, 1024, 14336)}
# bf16 outputs of sums over thousands of products: an ulp or two of the largest, relative (gpu_kernel_cases.measure)
QUANT_TOL = 3e-2


def _linears(h: int, q: int, kv: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def quant_kernel_cases(case: Callable, dev: str, smoke: bool, fp8_ok: bool) -> Iterator:
    """KernelCases (gpu_kernel_cases.case) of kernels/w4a16_gemm.py and kernels/fp8_gemm.py: batch 1 and 64 (the
    split-K and decode tiles) and a 512-row prefill, group 128 and 32 and a per-row group index (a tensor-parallel
    rank's act-order share); FP8 per token and static, through the dispatch (torch._scaled_mm on sm_90+) and the
    Triton kernel. And their helpers, bit for bit against their twins: the 4-bit weight's dequantization (long
    steps' dense path) and the FP8 activation quantization (on the CPU's twin: the GPU's torch ops are what the
    kernel replaced)."""
    from kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_gemm_triton
    from kernels.fp8_quant_rows import quantize_fp8, quantize_fp8_triton
    from kernels.w4a16_dequant import w4a16_dequant_ref, w4a16_dequant_triton
    from kernels.w4a16_gemm import w4a16_gemm_ref, w4a16_gemm_triton
    from shared.models.fp8_linear import quantize_fp8_weight

    shapes = {"tiny": {"mlp": (256, 96)}} if smoke else {s: _linears(*d) for s, d in QUANT_SHAPES.items()}
    bf16 = torch.bfloat16
    for shape, linears in shapes.items():
        for name, (k, n) in linears.items():
            # Llama-3.1-8B: its widest and its longest-K layers at the decode batches (the host builds every input)
            if shape == "llama-3.1-8b" and name not in ("gate_up", "down"):
                continue
            for m in (5,) if smoke else (1, 64) if shape == "llama-3.1-8b" else (1, 64, 512):
                for group, with_idx in ((128, False), (32, False), (128, True)):
                    def w4(randn, k=k, n=n, m=m, group=group, with_idx=with_idx):
                        # random words are random 4-bit values: no packing pass over K x N on the host
                        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=randn.g, dtype=torch.int32)
                        scales = (randn(k // group, n).abs() * 0.01 + 1e-3).to(torch.float16)
                        zeros = torch.randint(0, 16, (k // group, n), generator=randn.g).to(torch.uint8).to(scales.device)
                        g_idx = (torch.arange(k) // group).to(torch.int32).to(scales.device) if with_idx else None
                        x, qw = randn(m, k, dtype=bf16), qw.to(scales.device)
                        return (w4a16_gemm_triton(x, qw, scales, zeros, group, g_idx),
                                w4a16_gemm_ref(x, qw, scales, zeros, group, g_idx), QUANT_TOL)
                    label = f"{shape} {name} {k}x{n} M={m} group {group}" + (" g_idx" if with_idx else "")
                    yield case("w4a16_gemm", bf16, bf16, label, w4)
                if m == 1:  # the dense path of long steps: the weight dequantized once, bit for bit the twin's
                    def deq(randn, k=k, n=n):
                        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=randn.g, dtype=torch.int32)
                        scales = (randn(k // 128, n).abs() * 0.01 + 1e-3).to(torch.float16)
                        zeros = torch.randint(0, 16, (k // 128, n), generator=randn.g).to(torch.uint8)
                        qw, zeros = qw.to(scales.device), zeros.to(scales.device)
                        return (w4a16_dequant_triton(qw, scales, zeros, 128, None, bf16),
                                w4a16_dequant_ref(qw, scales, zeros, 128, None, bf16), 0.0)
                    yield case("w4a16_dequant", bf16, bf16, f"{shape} {name} {k}x{n} group 128", deq)
                if not fp8_ok:
                    continue
                for static in (False, True):
                    def quant(randn, k=k, m=m, static=static):
                        x = randn(m, k, dtype=bf16) * 3
                        inp = torch.tensor([0.02], device=x.device) if static else None
                        q, s = quantize_fp8_triton(x, inp)
                        wq, ws = quantize_fp8(x.cpu(), None if inp is None else inp.cpu())
                        # codes times scales: equal only when both are the twin's bits
                        return q.float() * s[:, None], (wq.float() * ws[:, None]).to(q.device), 0.0
                    act = "static" if static else "per token"
                    yield case("fp8_quant_rows", bf16, "fp8", f"{shape} {name} K={k} M={m} {act}", quant)
                for static in (False, True):
                    for path in ("dispatch", "triton"):
                        def f8(randn, k=k, n=n, m=m, static=static, path=path):
                            w = quantize_fp8_weight(randn(n, k) * 0.05)
                            x = randn(m, k, dtype=bf16)
                            inp = torch.tensor([0.02], device=x.device) if static else None
                            fn = fp8_gemm if path == "dispatch" else fp8_gemm_triton
                            return (fn(x, w.weight, w.weight_scale, inp), fp8_gemm_ref(x, w.weight, w.weight_scale, inp),
                                    QUANT_TOL)
                        act = "static" if static else "per token"
                        yield case("fp8_gemm", bf16, "fp8", f"{shape} {name} {k}x{n} M={m} {act} {path}", f8)


def quant_plan(smoke: bool, fp8_ok: bool) -> list[tuple[str, list[str], str]]:
    """(row name, `kvmesh bench` argv, JSON file) of each run: offline tok/s per method at the Qwen3-0.6B shape
    (the nano-vllm workload), decode ms/step at batch 1 and 64 per method there, then offline tok/s at the
    Llama-3.1-8B shape (64 of the workload's prompts, the step's cap). Smoke: the tiny bench model on CPU, FP8 and AWQ through
    the twins, batches 1 and 2."""
    if smoke:
        offline = [("bench", ["--num-prompts", "2", "--input-len-min", "4", "--input-len-max", "8", "--output-len-min",
                              "2", "--output-len-max", "3"])]
        decode = ("bench", ["--batch-sizes", ",".join(map(str, DECODE_BATCHES_SMOKE)), "--context-len", "32",
                            "--steps", "2", "--attn-batch", "2", "--attn-context", "64"])
    else:
        offline = [("qwen3-0.6b", ["--preset", "nano-vllm"]), ("llama-3.1-8b", ["--preset", "nano-vllm",
                                                                               "--num-prompts", "64"])]
        decode = ("qwen3-0.6b", ["--batch-sizes", ",".join(map(str, DECODE_BATCHES)), "--context-len", "512"])
    methods = ["auto"] + (["fp8"] if fp8_ok else []) + ["awq"]
    plan = []
    # the small shape's offline and decode rows first, the 8B shape's last: if the step's cap ends it, the
    # slowest rows are the ones lost
    for i, (shape, extra) in enumerate(offline):
        for method in methods:
            plan.append((f"{shape} {_label(method)}", ["offline", "--shape", shape, *extra, "--skip-hf",
                                                        *_quant_flag(method)], f"quant-offline-{shape}-{method}.json"))
        if i == 0:
            dshape, dextra = decode
            for method in methods:
                plan.append((f"decode {dshape} {_label(method)}",
                             ["decode", "--shape", dshape, *dextra, *_quant_flag(method)],
                             f"quant-decode-{dshape}-{method}.json"))
    return plan


DECODE_BATCHES = (1, 64)
DECODE_BATCHES_SMOKE = (1, 2)


def _label(method: str) -> str:
    return "bf16" if method == "auto" else method


def _quant_flag(method: str) -> list[str]:
    return [] if method == "auto" else ["--quantization", method]


def decode_table(runs: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Decode rows: {"decode SHAPE METHOD": {"1": ms/step, "64": ms/step}} from `kvmesh bench decode`'s JSON."""
    return {name: {str(r["batch"]): r.get("ms_per_step") for r in run["result"].get("steps", []) if "batch" in r}
            for name, run in runs.items() if name.startswith("decode ")}


def step_quant(args, bench: Callable[[object, list[str], Path], dict], fp8_ok: bool) -> dict:
    """Offline tok/s and decode ms/step in bf16, FP8 (sm_89+) and AWQ (quant_plan)."""
    runs: dict[str, dict] = {}
    for name, argv, file in quant_plan(args.smoke, fp8_ok):
        argv = [argv[0], "--device", args.device, *argv[1:]]
        runs[name] = bench(args, argv, Path(args.out) / file)
    tok_s = {k: r["result"].get("kvmesh_tok_s") for k, r in runs.items() if not k.startswith("decode ")}
    decode = decode_table(runs)
    summary = ", ".join([f"{k} {v or 0:.0f} tok/s" for k, v in tok_s.items()]
                        + [f"{k} " + " / ".join(f"{ms or 0:.2f}" for ms in row.values()) + " ms/step at batch "
                           + "/".join(row) for k, row in decode.items()])
    return {"ok": all(r["ok"] for r in runs.values()), "tok_s": tok_s, "decode_ms_per_step": decode, "runs": runs,
            "fp8_tested": fp8_ok, "summary": summary}
