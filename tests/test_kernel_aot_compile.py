"""Every Triton kernel variant the engine launches at real model shapes compiles for real GPUs (sm_80, sm_90,
sm_100) ahead of time on this CPU, with no spills and within each architecture's shared memory.

The variants are not written here: engines at the shapes of Qwen3-0.6B, Llama-3.1-8B, Mistral-7B (sliding
window), SmolLM2-135M (9 query / 3 KV heads) and FP8 KV serve batch 1, a mixed prefill + decode step and
decode-graph steps at a large batch under kernels/aot.py's LaunchRecorder, which binds each launch as
Triton's launcher would. A kernel or wrapper change that breaks compilation for a GPU fails here."""
from __future__ import annotations

import pytest

from kernels.aot import FP8_MIN_ARCH, SHARED_LIMIT, compile_variants
from kernels.triton_support import triton
from tests.kernel_launches import AOT_CASES, record_shape

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")

ARCHS = [80, 90, 100]
EVERY_KERNEL = {"_qk_rope_store_kernel", "_store_kv_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel",
                "_extend_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_apply_bitmask_kernel",
                "_lora_shrink_kernel", "_lora_expand_kernel"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("aot-shapes")
    return {case: record_shape(root, *case) for case in AOT_CASES}


@pytest.fixture(scope="module")
def reports(recorded):
    variants = list(dict.fromkeys(v for rec in recorded.values() for v in rec.variants))
    jobs = [(v, a) for v in variants for a in ARCHS if a >= FP8_MIN_ARCH or not v.fp8]
    by_arch: dict[int, list] = {}
    for v, a in jobs:
        by_arch.setdefault(a, []).append(v)
    out = []
    for arch, vs in by_arch.items():
        out += compile_variants(vs, [arch])
    print("\nkernel variant                                                   arch  regs  smem(B)  local(B)")
    for r in sorted(out, key=lambda r: (r.variant.kernel, r.variant.label(), r.arch)):
        print(f"{r.variant.label()[:64]:64s} sm{r.arch:<3d} {r.registers:4d} {r.shared_bytes:8d} {r.local_bytes:9d}"
              + ("" if r.ok else f"  FAILED {r.error}"))
    return out


def test_the_recorded_launches_cover_every_kernel_and_each_shape(recorded):
    every = set().union(*(rec.kernels() for rec in recorded.values()))
    assert every == EVERY_KERNEL
    smol = recorded[("smollm2-135m", "auto")]
    groups = {dict((v.signature[p[0]][0], x) for p, x in v.constexprs).get("GROUP") for v in smol.variants}
    assert 3 in groups, "SmolLM2's 9/3 heads launch the attention kernels with a group of 3"
    mistral = recorded[("mistral-7b", "auto")]
    assert any("HAS_WINDOW=True" in v.label() for v in mistral.variants), "Mistral's sliding window is compiled"
    assert any(v.fp8 for v in recorded[("qwen3-0.6b", "fp8")].variants)


def test_every_variant_compiles_for_sm80_sm90_sm100_without_spills(reports):
    failed = [f"{r.variant.label()} sm_{r.arch}: {r.error}" for r in reports if not r.ok]
    assert not failed, "\n".join(failed)
    spills = [f"{r.variant.label()} sm_{r.arch}: {r.local_bytes} local bytes" for r in reports if r.local_bytes]
    assert not spills, "\n".join(spills)
    over = [f"{r.variant.label()} sm_{r.arch}: {r.shared_bytes} > {SHARED_LIMIT[r.arch]}" for r in reports
            if not r.shared_ok]
    assert not over, "\n".join(over)
    assert {r.arch for r in reports} == set(ARCHS)


def test_fp8_kv_cannot_compile_below_sm89_which_the_config_refuses(recorded):
    fp8 = next(v for v in recorded[("smollm2-135m", "fp8")].variants if v.fp8 and v.kernel == "_qk_rope_store_kernel")
    (report,) = compile_variants([fp8], [80])
    assert not report.ok and "fp8e4nv" in report.error
