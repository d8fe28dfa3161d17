"""Where the time of a quantized linear layer goes on a GPU: bf16 `F.linear` against the FP8 path (per-token
activation quantization, `torch._scaled_mm`, both together as `fp8_gemm` dispatches them, and the Triton kernel)
and the 4-bit path (the Triton W4A16 kernel, the weight's dequantization alone and followed by a dense product,
and `w4a16_gemm` as it dispatches), at the linear layers of Llama-3.1-8B (or Qwen3-0.6B) for decode batches and
prefill chunks. Times are the median of
`triton.testing.do_bench`; JSON with commit, date, machine and command.

    python -m loadtest.experiments.gpu_quant.gemm_breakdown --json gemm_breakdown.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,64,256,2048,16384", help="comma list of M (tokens in the step)")
    p.add_argument("--shape", default="llama-3.1-8b", choices=["llama-3.1-8b", "qwen3-0.6b"])
    p.add_argument("--json", default="", help="write the table here")
    args = p.parse_args(argv)

    import triton.testing

    from kernels.fp8_gemm import fp8_gemm, fp8_gemm_triton
    from kernels.fp8_quant_rows import quantize_fp8
    from kernels.w4a16_dequant import w4a16_dequant_triton
    from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_triton
    from loadtest.gpu_check_quant import QUANT_SHAPES, _linears
    from loadtest.report_json import provenance
    from shared.models.fp8_linear import quantize_fp8_weight

    dev, bf16, g = "cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (k, n) in _linears(*QUANT_SHAPES[args.shape]).items():
        w = torch.randn(n, k, device=dev, generator=g).to(bf16) * 0.05
        f8 = quantize_fp8_weight(w)
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device=dev, generator=g, dtype=torch.int32)
        scales = (torch.rand(k // 128, n, device=dev, generator=g) * 0.01 + 1e-3).to(torch.float16)
        zeros = torch.randint(0, 16, (k // 128, n), device=dev, generator=g).to(torch.uint8)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).to(bf16)
            xq, xs = quantize_fp8(x)
            wt = f8.weight.t()
            ms = {
                "bf16_linear": lambda: F.linear(x, w),
                "fp8_quantize": lambda: quantize_fp8(x),
                "fp8_scaled_mm_only": lambda: torch._scaled_mm(xq, wt, scale_a=xs.reshape(-1, 1),
                                                               scale_b=f8.weight_scale.reshape(1, -1), out_dtype=bf16),
                "fp8_gemm": lambda: fp8_gemm(x, f8.weight, f8.weight_scale),
                "fp8_triton": lambda: fp8_gemm_triton(x, f8.weight, f8.weight_scale),
                "w4a16_triton": lambda: w4a16_gemm_triton(x, qw, scales, zeros, 128),
                "w4a16_dequant_only": lambda: w4a16_dequant_triton(qw, scales, zeros, 128, None, bf16),
                "w4a16_dequant_then_linear": lambda: x @ w4a16_dequant_triton(qw, scales, zeros, 128, None, bf16),
                "w4a16_gemm": lambda: w4a16_gemm(x, qw, scales, zeros, 128),
            }
            row = {"layer": name, "k": k, "n": n, "m": m}
            for label, fn in ms.items():
                try:
                    row[label] = round(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"), 4)
                except Exception as e:  # noqa: BLE001 - one path failing must not hide the others' times
                    row[label] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**provenance(), "gpu": torch.cuda.get_device_name(), "unit": "ms (median)", "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
