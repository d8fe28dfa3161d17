"""The GPU check's kernel cases: every Triton kernel against its torch twin, as a list that can be split.

Each case builds its own inputs from a generator seeded by its own name, so the list is the same in every
process and a shard (`cases[i::n]`) runs without the others: the kernels step runs the shards in parallel
processes (Triton compiles on the host, one variant at a time per process) and appends each finished case
to one JSON-lines file. Indices and lengths are int32, as the engine launches them (int64 would compile
variants the engine never runs).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# |triton - twin| / (1 + |twin|): bf16 / fp16 results may differ by an ulp or two (rounding order).
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
# One e4m3 step relative to the value (3 mantissa bits): the fused q/k-norm + rotary kernel rounds K from float32
# straight to FP8, its twin through the activations' dtype first, so the two may land one FP8 step apart.
FP8_STEP = 2.0**-3
# (query heads, KV heads, head_dim): Qwen3-0.6B, Llama-3.1-8B / Mistral-7B, SmolLM2-135M.
GPU_HEADS = [(16, 8, 128), (32, 8, 128), (9, 3, 64)]


@dataclass(frozen=True)
class KernelCase:
    kernel: str
    dtype: str  # the activations' dtype
    kv: str  # the KV cache's dtype ("fp8" or the activations')
    name: str
    run: Callable[[], tuple[torch.Tensor, torch.Tensor, float]]  # -> (triton's, the twin's, tolerance)

    @property
    def key(self) -> str:
        return f"{self.kernel} {self.dtype}/{self.kv} {self.name}"


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gen(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=6).digest(), "big"))


def measure(case: KernelCase, device: str) -> dict:
    """Run a case twice: the first launch compiles (Triton's JIT), the second is warm; the difference is about
    the compile time. Error is relative to the magnitude (an ulp grows with it), absolute below 1."""
    def timed() -> tuple[torch.Tensor, torch.Tensor, float, float]:
        t0 = time.perf_counter()
        got, want, tol = case.run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return got, want, tol, time.perf_counter() - t0

    got, want, tol, first = timed()
    _, _, _, warm = timed()
    diff = (got.float() - want.float()).abs() / (1 + want.float().abs())
    err = diff.max().item() if got.numel() else 0.0
    return {"kernel": case.kernel, "dtype": case.dtype, "kv": case.kv, "case": case.name, "max_rel_err": err,
            "tol": tol, "ok": math.isfinite(err) and err <= tol, "first_s": round(first, 4),
            "compile_s": round(max(first - warm, 0.0), 4)}


def kernel_cases(device: str, smoke: bool, fp8: bool) -> list[KernelCase]:
    """Every case, in a fixed order. Full: bf16 and fp16 at the served head shapes, with FP8 KV where the GPU has
    it; the extend-attention tile sweep only where the engine tunes (bf16 model dtype, no window). Smoke: one
    shape in bf16, tiny sizes (Triton's interpreter)."""
    return list(_cases(device, smoke, fp8))


def _cases(dev: str, smoke: bool, fp8_ok: bool) -> Iterator[KernelCase]:
    from kernels.decode_attention import decode_attention_ref, decode_attention_triton
    from kernels.extend_attention import candidate_tiles, extend_attention_ref, extend_attention_triton
    from kernels.qk_rope_store import qk_rope_store_ref, qk_rope_store_triton
    from kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
    from kernels.rotary import rotary_ref, rotary_triton
    from kernels.silu_mul import silu_mul_ref, silu_mul_triton
    from kernels.store_kv import FP8_DTYPE, store_kv_ref, store_kv_triton
    from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton
    from shared.models.model_config import RopeConfig
    from shared.models.rope import cos_sin_cache

    # A GPU converts float32 -> e4m3 exactly like torch; Triton's interpreter (CPU smoke) misrounds just below
    # powers of two (tests/test_kernel_small.py).
    fp8_store_tol = 0.0 if dev.startswith("cuda") else 0.6
    dtypes = [torch.bfloat16] if smoke else [torch.bfloat16, torch.float16]
    heads = [(9, 3, 64)] if smoke else GPU_HEADS
    hidden_sizes = [576] if smoke else [576, 1024, 4096]
    batch, ctx_max = (3, 40) if smoke else (64, 2048)
    tables = {}

    def rope_table(d: int) -> torch.Tensor:
        if d not in tables:
            tables[d] = cos_sin_cache(RopeConfig(theta=1e6 if d == 128 else 1e5), d, 4096).to(dev)
        return tables[d]

    def case(kernel: str, dtype, kv, name: str, body: Callable[[Callable], tuple]) -> KernelCase:
        def run() -> tuple:
            g = _gen(made.key)  # its inputs from its own name: the same in every process and shard

            def randn(*shape, dtype=torch.float32):
                return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)
            randn.g = g
            return body(randn)
        made = KernelCase(kernel, _dname(dtype), kv if isinstance(kv, str) else _dname(kv), name, run)
        return made

    for dtype in dtypes:
        tol = TOL[dtype]
        for hidden in hidden_sizes:
            def rms(randn, hidden=hidden, dtype=dtype, tol=tol):
                x, w = randn(8, hidden, dtype=dtype), randn(hidden, dtype=dtype)
                return rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), tol

            def add_rms(randn, hidden=hidden, dtype=dtype, tol=tol):
                x, r, w = randn(8, hidden, dtype=dtype), randn(8, hidden, dtype=dtype), randn(hidden, dtype=dtype)
                want = add_rms_norm_ref(x, r, w, 1e-6)
                got = add_rms_norm_triton(x.clone(), r.clone(), w, 1e-6)
                return torch.cat(got), torch.cat(want), tol
            yield case("rms_norm", dtype, dtype, f"hidden {hidden}", rms)
            yield case("add_rms_norm", dtype, dtype, f"hidden {hidden}", add_rms)
        for hq, hk, d in heads:
            shape = f"{hq}/{hk}x{d}"

            def rot(randn, hq=hq, hk=hk, d=d, dtype=dtype, tol=tol):
                tokens = 7
                qkv = randn(tokens, (hq + 2 * hk) * d, dtype=dtype)
                pos = torch.randint(0, 4000, (tokens,), generator=randn.g, dtype=torch.int32).to(dev)
                outs = []
                for fn in (rotary_triton, rotary_ref):
                    y = qkv.clone()
                    fn(y[:, : hq * d].view(tokens, hq, d), y[:, hq * d:(hq + hk) * d].view(tokens, hk, d), pos,
                       rope_table(d))
                    outs.append(y)
                return outs[0], outs[1], 4 * tol

            def silu(randn, hq=hq, d=d, dtype=dtype, tol=tol):
                x = randn(7, 2 * hq * d, dtype=dtype)
                return silu_mul_triton(x), silu_mul_ref(x), tol
            yield case("rotary", dtype, dtype, shape, rot)
            yield case("silu_mul", dtype, dtype, f"inter {hq * d}", silu)
            for kv_dtype in [dtype] + ([FP8_DTYPE] if fp8_ok else []):
                is_fp8 = kv_dtype == FP8_DTYPE
                kv = "fp8" if is_fp8 else _dname(dtype)
                store_tol = fp8_store_tol if is_fp8 else 0.0
                scales = (1.25, 0.75) if is_fp8 else (1.0, 1.0)
                slots = [0, 17, -1, 31, 5, 40, 63]

                def store(randn, hk=hk, d=d, dtype=dtype, kv_dtype=kv_dtype, store_tol=store_tol):
                    k, v = randn(7, hk, d, dtype=dtype), randn(7, hk, d, dtype=dtype)
                    s = torch.tensor(slots, dtype=torch.int32, device=dev)
                    caches = [torch.zeros(4, 16, hk, d, device=dev, dtype=kv_dtype) for _ in range(4)]
                    store_kv_triton(k, v, caches[0], caches[1], s, 0.5, 0.5)
                    store_kv_ref(k, v, caches[2], caches[3], s, 0.5, 0.5)
                    return torch.cat(caches[:2]), torch.cat(caches[2:]), store_tol
                yield case("store_kv", dtype, kv, f"{shape}", store)
                # The fused q/k norm + rotary + store-KV, with and without the norm (Qwen3 / the others).
                for norm in (False, True):
                    for part in ("q", "k/v cache"):
                        def fused(randn, hq=hq, hk=hk, d=d, dtype=dtype, kv_dtype=kv_dtype, norm=norm, part=part,
                                  tol=tol, is_fp8=is_fp8, store_tol=store_tol):
                            qkv = randn(7, (hq + 2 * hk) * d, dtype=dtype)
                            w = (randn(d).abs() + 0.5).to(dtype) if norm else None
                            pos = torch.randint(0, 4000, (7,), generator=randn.g, dtype=torch.int32).to(dev)
                            s = torch.tensor(slots, dtype=torch.int32, device=dev)
                            c = [torch.zeros(4, 16, hk, d, device=dev, dtype=kv_dtype) for _ in range(4)]
                            got = qk_rope_store_triton(qkv.clone(), hq, hk, d, w, w, 1e-6, pos, rope_table(d), c[0],
                                                       c[1], s, 0.5, 0.5)
                            want = qk_rope_store_ref(qkv.clone(), hq, hk, d, w, w, 1e-6, pos, rope_table(d), c[2],
                                                     c[3], s, 0.5, 0.5)
                            if part == "q":
                                return got, want, 4 * tol
                            kv_tol = max(4 * tol, FP8_STEP if is_fp8 else 0.0, store_tol)
                            return torch.cat(c[:2]), torch.cat(c[2:]), kv_tol
                        yield case("qk_rope_store", dtype, kv, f"{shape} norm {norm}: {part}", fused)

                def paged(randn, hk=hk, d=d, kv_dtype=kv_dtype):
                    """A paged cache of shuffled blocks, contexts from 1 to ctx_max."""
                    blocks_per = -(-ctx_max // 16)
                    nblocks = batch * blocks_per + 1
                    kc = (randn(nblocks, 16, hk, d) / 2).to(kv_dtype)
                    vc = (randn(nblocks, 16, hk, d) / 2).to(kv_dtype)
                    perm = torch.randperm(nblocks, generator=randn.g)[: batch * blocks_per]
                    tbl = perm.view(batch, blocks_per).to(torch.int32).to(dev)
                    lens = torch.randint(1, ctx_max + 1, (batch,), generator=randn.g, dtype=torch.int32)
                    lens[0] = ctx_max
                    return kc, vc, tbl, lens.to(dev)
                for window in (None, 64):
                    for splits in (None, 7):  # the default for the batch, and split-KV + reduce
                        def dec(randn, hq=hq, d=d, dtype=dtype, window=window, splits=splits, scales=scales, tol=tol,
                                paged=paged):
                            kc, vc, tbl, lens = paged(randn)
                            q = randn(batch, hq, d, dtype=dtype)
                            want = decode_attention_ref(q, kc, vc, tbl, lens, d ** -0.5, window, *scales)
                            got = decode_attention_triton(q, kc, vc, tbl, lens, d ** -0.5, window, *scales,
                                                          num_splits=splits)
                            return got, want, tol
                        yield case("decode_attention", dtype, kv, f"{shape} batch {batch} ctx<={ctx_max} window "
                                   f"{window} splits {splits or 'default'}", dec)
                # Extend attention: a fresh prompt, a chunk after a cached prefix, a one-row chunk. The tile sweep
                # where the engine's warm-up tunes: bf16 activations, no window.
                sweep = candidate_tiles(d) if dtype == torch.bfloat16 else []
                for window in (None, 24):
                    for tiles in [None] + (sweep if window is None else []):
                        def ext(randn, hq=hq, d=d, dtype=dtype, window=window, tiles=tiles, scales=scales, tol=tol,
                                paged=paged):
                            kc, vc, tbl, _ = paged(randn)
                            chunks = [min(ctx_max, 40), 9, 1]
                            ctxs = [chunks[0], min(ctx_max, 37), min(ctx_max, 50)]
                            starts = torch.tensor([0, chunks[0], chunks[0] + chunks[1], sum(chunks)],
                                                  dtype=torch.int32, device=dev)
                            ctx_t = torch.tensor(ctxs, dtype=torch.int32, device=dev)
                            qx = randn(sum(chunks), hq, d, dtype=dtype)
                            extra = {} if tiles is None else {"tiles": tiles}
                            got = extend_attention_triton(qx, kc, vc, starts, ctx_t, tbl[:3], max(chunks), d ** -0.5,
                                                          window, *scales, **extra)
                            want = extend_attention_ref(qx, kc, vc, starts, ctx_t, tbl[:3], max(chunks), d ** -0.5,
                                                        window, *scales)
                            return got, want, tol
                        yield case("extend_attention", dtype, kv, f"{shape} window {window} tiles "
                                   f"{tiles or 'default'}", ext)
    vocab = 1000 if smoke else 151936

    def bitmask(randn):
        logits = randn(4, vocab)
        mask = torch.randint(-2**31, 2**31 - 1, (4, -(-vocab // 32)), generator=randn.g, dtype=torch.int64)
        mask = mask.to(torch.int32).to(dev)
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_triton(a, mask)
        apply_token_bitmask_ref(b, mask)
        return (a == b).logical_not().float(), torch.zeros_like(a), 0.0
    yield case("token_bitmask", torch.float32, "float32", f"vocab {vocab}", bitmask)
    from loadtest.gpu_check_quant import quant_kernel_cases

    yield from quant_kernel_cases(case, dev, smoke, fp8_ok)
