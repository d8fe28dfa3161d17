"""The quantized GEMM kernels (kernels/w4a16_gemm.py, kernels/fp8_gemm.py) and their helpers (the 4-bit weight's
dequantization, kernels/w4a16_dequant.py; the FP8 activation quantization, kernels/fp8_quant_rows.py) compile
ahead of time for sm_80 and sm_90 (FP8: sm_90 only; e4m3 needs sm_89) with no spills and within shared memory, at
the launches the wrappers make for the linear layers of Llama-3.1-8B and Qwen3-0.6B at batch 1, 64 and a
2,048-token prefill: the wrappers are called under kernels/aot.py's LaunchRecorder, which binds each launch as
Triton's launcher would."""
from __future__ import annotations

import pytest
import torch

from kernels.aot import FP8_MIN_ARCH, SHARED_LIMIT, LaunchRecorder, compile_variants
from kernels.fp8_gemm import FP8, fp8_gemm_triton
from kernels.fp8_quant_rows import quantize_fp8_triton
from kernels.triton_support import triton
from kernels.w4a16_dequant import w4a16_dequant_triton
from kernels.w4a16_gemm import w4a16_gemm_triton

pytestmark = [pytest.mark.skipif(triton is None, reason="triton is not installed"), pytest.mark.slow]

# (hidden, q, kv, intermediate) of the models the GPU check serves.
SHAPES = {"llama-3.1-8b": (4096, 4096, 1024, 14336), "qwen3-0.6b": (1024, 2048, 1024, 3072)}
ROWS = (1, 64, 2048)
ARCHS = (80, 90)


def _linears(h: int, q: int, kv: int, inter: int) -> list[tuple[int, int]]:
    """(K, N) of the fused q/k/v, o, fused gate/up and down projections."""
    return [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]


def record() -> LaunchRecorder:
    with LaunchRecorder() as rec:
        for shape in SHAPES.values():
            for k, n in _linears(*shape):
                qweight = torch.empty(k // 8, n, dtype=torch.int32)
                w8 = torch.empty(n, k, dtype=FP8)
                ws = torch.empty(n, dtype=torch.float32)
                scales = torch.empty(k // 128, n, dtype=torch.float16)
                zeros = torch.empty(k // 128, n, dtype=torch.uint8)
                w4a16_dequant_triton(qweight, scales, zeros, 128, None, torch.bfloat16)
                w4a16_dequant_triton(qweight, scales, zeros, 128, torch.zeros(k, dtype=torch.int32), torch.bfloat16)
                for m in ROWS:
                    x = torch.empty(m, k, dtype=torch.bfloat16)
                    for group in (32, 128):
                        scales = torch.empty(k // group, n, dtype=torch.float16)
                        zeros = torch.empty(k // group, n, dtype=torch.uint8)
                        w4a16_gemm_triton(x, qweight, scales, zeros, group)
                    # a tensor-parallel rank's act-order share: a per-row group index
                    w4a16_gemm_triton(x, qweight, scales, zeros, 128, torch.zeros(k, dtype=torch.int32))
                    fp8_gemm_triton(x, w8, ws)
                    fp8_gemm_triton(x, w8, ws, torch.ones(1))
                    quantize_fp8_triton(x)
                    quantize_fp8_triton(x, torch.ones(1))
    return rec


@pytest.fixture(scope="module")
def reports():
    variants = list(record().variants)
    out = []
    for arch in ARCHS:
        out += compile_variants([v for v in variants if arch >= FP8_MIN_ARCH or not v.fp8], [arch])
    print("\nkernel variant                                                   arch  regs  smem(B)  local(B)")
    for r in sorted(out, key=lambda r: (r.variant.label(), r.arch)):
        print(f"{r.variant.label()[:64]:64s} sm{r.arch:<3d} {r.registers:4d} {r.shared_bytes:8d} {r.local_bytes:9d}"
              + ("" if r.ok else f"  FAILED {r.error}"))
    return out


def test_quantized_gemms_compile_for_sm80_sm90_without_spills(reports) -> None:
    assert {r.variant.kernel for r in reports} == {"_w4a16_kernel", "_fp8_gemm_kernel", "_w4a16_dequant_kernel",
                                                   "_fp8_quant_rows_kernel"}
    assert any("SPLIT_K=1" not in r.variant.label() for r in reports if r.variant.kernel == "_w4a16_kernel")
    failed = [f"{r.variant.label()} sm_{r.arch}: {r.error}" for r in reports if not r.ok]
    assert not failed, "\n".join(failed)
    spills = [f"{r.variant.label()} sm_{r.arch}: {r.local_bytes} local bytes" for r in reports if r.local_bytes]
    assert not spills, "\n".join(spills)
    over = [f"{r.variant.label()} sm_{r.arch}: {r.shared_bytes}" for r in reports if not r.shared_ok]
    assert not over, "\n".join(over)
    assert {r.arch for r in reports if r.variant.fp8} == {90}
