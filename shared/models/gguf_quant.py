"""Serve a GGUF's quantized weights on CPU without dequantizing them to bf16 (`--quantization gguf`; `gguf-hybrid`,
the default for a converted GGUF served in bf16 on a CPU, also keeps a bf16 twin for steps of more than 4 rows;
`--quantization none` serves the dequantized weights).

- Q4_0 / Q4_1 / Q4_K linear layers become Int4Linear (shared/models/quant_linear.py, torch's
  `aten._weight_int4pack_mm_for_cpu`, group 32) from the file's own blocks (shared/models/gguf_blocks.py): the
  same 4-bit codes, and per block scale = d and zero = m + 8 d (Q4_1) or 0 (Q4_0), which the kernel takes in
  bf16 when the activations are bf16. fp16 d rounded to bf16 moves each weight by at most 8 |d| 2^-9 (plus
  |m + 8 d| 2^-9 for Q4_1); bf16 dequantized weights are themselves rounded by up to |w| 2^-9, so the two are
  about as far from the exact dequantization (measured: perplexity +0.4% against the bf16 ones).
- Q8_0 linear layers (and SmolLM2's Q8_0 output head, tied to the embeddings) become Int8Linear: torch's int8
  kernel has one scale per row, not per 32 values, so the exact dequantized rows are requantized per row
  (max |w| / 127). That is not the file's rounding; its error is measured beside the Q4 one.
- Everything else (F32/F16/BF16, Q5, Q5_K and Q6_K) keeps the dequantized weights in the model dtype; embeddings
  and norms always do. A fused layer (q/k/v, gate/up) goes native only when all its parts are Q4_0/Q4_1/Q4_K, or all Q8_0.

On a CPU without native bf16 (no AVX512-BF16 / AMX: most laptops, AVX2 servers) the model computes in float32 and
the blocks go to this project's own kernels instead (GgufLinear, kernels/cpu/gemv_gguf.cpp): Q4_0/Q4_1/Q4_K codes
with float32 d and m, Q8_0 codes with float32 d (recovered exactly from the dequantized weights), Q6_K codes minus
32 with a float32 d per 16, multiplied with the activations rounded to int8 blocks of 32 in decode-sized steps
(GGUF_ACT, measured faster than float32 activations for Q4 and Q8_0) and as float32 tiles in prefill. `--quantization auto` picks this where
`--dtype auto` chose float32 for lack of native bf16; `--quantization gguf` picks it for any float32 serving.

In bf16 on a CPU whose bf16 matmuls are the kernels' own (AVX512-BF16 without AMX, shared/models/dp_linear.py) the
blocks go to the same GgufLinear kernels, which take the bf16 activations as they are (Q8_0 blocks rebuilt from the
bf16 weights: d within a bf16 rounding of the file's), and the hybrid's twin is a DpLinear: every matmul is then on
the kernels' own threads. The int4/int8 layers above serve bf16 elsewhere (AMX CPUs, KVMESH_CPU_BF16_LINEAR=onednn).
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.models.gguf_blocks import BLOCKS_FILE, NATIVE_Q4, NATIVE_Q8
from shared.models.quant_linear import GgufLinear, Int4Linear, Int8Linear

log = logging.getLogger(__name__)

# gguf: the quantized layers only. gguf-hybrid: each also keeps the dequantized weight, packed bf16, for steps of
# more than HYBRID_MAX_ROWS rows, where torch's int4/int8 CPU kernels (which unpack the weight again for every
# few rows) are slower than oneDNN's bf16 matmul (0.6-0.97x at 8-32 rows): 1.25x bf16's memory.
GGUF_MODES = ("gguf", "gguf-hybrid")
HYBRID_MAX_ROWS = 4
# The same split where both halves are the kernels' own (GgufLinear up to here, DpLinear above; bf16 on a CPU with
# AVX512-BF16 and no AMX). Measured on a 2-core Zen 5, the demo model's decode step (ms) at 1 / 2 / 3 / 4 / 8 rows:
# 4.5 / 5.1 / 6.5 / 7.6-7.9 / 9.5-10.2 split here, 4.9-5.4 / 6.2-6.3 / 7.5 / 8.0 / 10.2 with DpLinear alone; its
# linear layers alone from memory, GGUF vs DpLinear: 5.2 vs 5.2 ms at 1 row, 7.4 vs 6.0 at 4, 11.1 vs 7.2 at 8.
OWN_HYBRID_MAX_ROWS = 4
# What --quantization auto serves a GGUF as: hybrid, because pure int4 measured 0.58-0.67x of bf16 at batch 32 and
# every prefill chunk (tens of rows) would go through the slow path too; gguf when memory matters more.
AUTO_MODE = "gguf-hybrid"
# Float32 serving: the activation mode per GGUF format (kernels/cpu/gemv_gguf.py's ACT_F32 / ACT_Q8), measured by
# loadtest/experiments/cpu_quant/cpu_gemv.py; KVMESH_CPU_GGUF_ACT=f32|q8 sets both (for measuring the other).
GGUF_ACT = {"Q4": "q8", "Q8_0": "q8", "Q6_K": "q8"}
ACT_ENV = "KVMESH_CPU_GGUF_ACT"


class RowSplitLinear(nn.Module):
    """A quantized layer for steps of at most max_rows rows, its dense twin for larger ones."""

    def __init__(self, quantized: nn.Module, dense: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.quantized, self.dense, self.max_rows = quantized, dense, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.quantized(x) if rows <= self.max_rows else self.dense(x)


def _with_dense(new: nn.Module, old: nn.Linear, max_rows: int | None, own: bool) -> nn.Module:
    if max_rows is None:
        return new
    from shared.models.dp_linear import DpLinear, can_take
    from shared.models.packed_linear import PackedLinear, packing_available

    if own and can_take(old):
        dense = DpLinear(old.weight, old.bias)
    elif packing_available() and old.weight.dtype == torch.bfloat16:
        dense = PackedLinear(old.weight, old.bias)
    else:
        dense = old
    return RowSplitLinear(new, dense, max_rows)

# The linear layers of a decoder layer, with the checkpoint tensors fused into each, in row order (the order
# shared/models/loader.py's weight_plan stacks them).
_PARTS = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


def has_gguf_blocks(model_dir: str | Path) -> bool:
    return (Path(model_dir) / BLOCKS_FILE).is_file()


def resolve_gguf_quantization(requested: str, model: str, device: str, dtype: str, load_format: str,
                              tensor_parallel_size: int) -> str | None:
    """auto / none / gguf / gguf-hybrid -> a GGUF mode or None, logged. auto: AUTO_MODE for a converted GGUF with
    Q4/Q8_0 weights served in bf16 on a CPU (the int4/int8 kernels compute in bf16), by one rank, from its weights
    (not dummy ones); "gguf" (the float32 block kernels) where `--dtype auto` serves float32 because the CPU has no
    native bf16 and the C++ CPU kernels are on."""
    from kernels.cpu.extension import requested as cpu_kernels
    from shared.engine.errors import ConfigError
    from shared.models.cpu_dtype import NO_NATIVE_BF16, default_cpu_dtype

    if requested == "none":
        return None
    mode = requested if requested in GGUF_MODES else AUTO_MODE
    blocks = load_format != "dummy" and has_gguf_blocks(model)
    served, dtype_why = default_cpu_dtype() if dtype == "auto" and device == "cpu" else (dtype, "--dtype")
    if not blocks:
        why = "not a converted GGUF with Q4_0/Q4_1/Q4_K/Q8_0 weights"
    elif device != "cpu":
        why = f"not a CPU device ({device})"
    elif tensor_parallel_size > 1:
        why = "tensor parallelism"
    elif served == "bfloat16":
        why = None
    elif served != "float32":
        why = f"serving {served}, and the block kernels compute in bfloat16 or float32"
    elif cpu_kernels() != "native":
        why = "serving float32, and the C++ CPU kernels (the float32 block kernels) are off"
    elif requested == "auto" and dtype_why != NO_NATIVE_BF16:
        why = f"serving float32 by choice ({dtype_why}); --quantization gguf serves the blocks in float32 too"
    else:
        why = None
    if requested in GGUF_MODES and why is not None:
        raise ConfigError(f"--quantization {requested} serves a GGUF's quantized weights natively on one CPU worker "
                          f"in bfloat16 or, with the C++ CPU kernels, float32; here: {why}")
    if why is not None:
        if blocks:
            log.info("GGUF weights dequantized (--quantization auto: %s)", why)
        return None
    if served == "float32":
        log.info("GGUF weights served as stored, float32 compute (--quantization %s -> gguf: %s; the C++ block "
                 "kernels of kernels/cpu/gemv_gguf.cpp; --quantization none dequantizes them)", requested,
                 NO_NATIVE_BF16 if requested == "auto" else "requested")
        return "gguf"  # the float32 kernels multiply prefill tiles themselves: no bf16 twin
    log.info("GGUF weights served as stored (--quantization %s -> %s; --quantization none dequantizes them)",
             requested, mode)
    return mode


def gguf_types(model_dir: str | Path) -> dict[str, str]:
    with safe_open(str(Path(model_dir) / BLOCKS_FILE), framework="pt") as f:
        return json.loads(f.metadata()["gguf_types"])


def _unpack(pairs: torch.Tensor) -> torch.Tensor:
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).view(pairs.shape[0], -1)


def _act(fmt: str) -> int:
    from kernels.cpu.gemv_gguf import ACT_F32, ACT_Q8

    choice = os.environ.get(ACT_ENV) or GGUF_ACT[fmt]
    if choice not in ("f32", "q8"):
        raise ValueError(f"{ACT_ENV}={choice!r}: choose f32 or q8")
    return ACT_Q8 if choice == "q8" else ACT_F32


def _native(layer: nn.Module, names: list[str], types: dict[str, str], f, blocks: bool) -> nn.Module | None:  # noqa: ANN001
    """The layer on the GGUF block kernels (blocks: GgufLinear) or torch's int4/int8 ones, or None."""
    kinds = {types.get(n) for n in names}
    if kinds <= set(NATIVE_Q4):  # Q4 parts mix: all are codes, scale and minimum per 32
        q = torch.cat([_unpack(f.get_tensor(f"{n}.codes")) for n in names])
        d = torch.cat([f.get_tensor(f"{n}.d") for n in names])
        m = torch.cat([f.get_tensor(f"{n}.m") for n in names])
        if blocks:
            return GgufLinear.from_q4(q, d, m, layer.bias, _act("Q4"), "+".join(sorted(kinds)))
        return Int4Linear.from_blocks(q, d, m, layer.bias)
    if kinds == {"Q8_0"}:
        if blocks:
            new, exact = GgufLinear.from_q8_0(layer.weight, layer.bias, _act("Q8_0"))
            if not exact and layer.weight.dtype == torch.float32:  # bf16 weights are rounded: rebuilt, as expected
                log.warning("%s: the dequantized weights are not exactly Q8_0 blocks; requantized to Q8_0", names[0])
            return new
        return Int8Linear(layer.weight, layer.bias)
    if kinds <= set(NATIVE_Q8) and blocks:  # Q6_K: int8 codes (q - 32), a scale per 16
        q = torch.cat([f.get_tensor(f"{n}.codes") for n in names])
        d = torch.cat([f.get_tensor(f"{n}.d") for n in names])
        return GgufLinear.from_q8_16(q, d, layer.bias, _act("Q6_K"), "+".join(sorted(kinds)))
    return None  # bf16 serving keeps Q6_K dequantized: per-row int8 would round its per-16 scales away


@torch.no_grad()
def apply_gguf_blocks(model: nn.Module, model_dir: str | Path, tie_word_embeddings: bool,
                      dense_above: int | None = None) -> Counter:
    """Replace the model's linear layers whose GGUF type has a native kernel, in place (dense_above: keep a bf16
    twin for steps of more rows, RowSplitLinear); returns weights (elements)
    served natively per GGUF type (a fused layer of mixed Q4 parts counts as "Q4_0+Q4_1")."""
    from shared.models.dp_linear import dp_linear_choice

    types = gguf_types(model_dir)
    float32 = model.norm.weight.dtype == torch.float32
    # bf16 on a CPU whose bf16 matmuls are the kernels' own (shared/models/dp_linear.py): the blocks go to the
    # GGUF kernels too (they take bf16 activations), so every matmul is on the kernels' threads.
    own = not float32 and model.norm.weight.dtype == torch.bfloat16 and dp_linear_choice()[0]
    if own and dense_above is not None:
        dense_above = OWN_HYBRID_MAX_ROWS
    served: Counter = Counter()
    if float32:
        from kernels.cpu.extension import native_status

        ok, why = native_status()
        if not ok:
            log.warning("GGUF weights dequantized to float32: the C++ block kernels did not load (%s)", why)
            return served
        dense_above = None  # the float32 kernels multiply large steps by dequantized tiles themselves
    kept: Counter = Counter()  # the same for layers left dequantized
    with safe_open(str(Path(model_dir) / BLOCKS_FILE), framework="pt") as f:
        for i, layer in enumerate(model.layers):
            for (parent_name, name), parts in _PARTS.items():
                parent = getattr(layer, parent_name)
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                old = getattr(parent, name)
                new = _native(old, names, types, f, float32 or own)
                if new is not None:
                    setattr(parent, name, _with_dense(new, old, dense_above, own))
                (kept if new is None else served)["+".join(sorted({types[n] for n in names}))] += old.weight.numel()
        head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
        new = _native(model.lm_head, [head], types, f, float32 or own)
        if new is not None:
            served[types[head]] += model.lm_head.weight.numel()
            model.lm_head = _with_dense(new, model.lm_head, dense_above, own)
    kept_text = ", ".join(f"{t} {n / 1e6:.1f} M" for t, n in sorted(kept.items())) or "nothing"
    served_text = ", ".join(f"{t} {n / 1e6:.1f} M" for t, n in sorted(served.items())) or "none"
    if float32:
        acts = {fmt: "int8" if _act(fmt) else "float32" for fmt in ("Q4", "Q8_0", "Q6_K")}
        log.info("GGUF weights served as stored on CPU, float32 compute (no float32 copy): %s; C++ block kernels "
                 "(kernels/cpu/gemv_gguf.cpp) with %s activations for Q4, %s for Q8_0 and %s for Q6_K in steps of up "
                 "to 16 rows, float32 tiles above; kept dequantized: %s", served_text, acts["Q4"], acts["Q8_0"],
                 acts["Q6_K"], kept_text)
        return served
    if own:
        log.info("GGUF weights served as stored on CPU, bf16 compute: %s; C++ block kernels (kernels/cpu/gemv_gguf.cpp, "
                 "bf16 activations in; Q8_0 blocks rebuilt from the bf16 weights)%s; kept "
                 "dequantized: %s", served_text, "" if dense_above is None else
                 f"; a bf16 twin on the AVX512-BF16 kernel serves steps of more than {dense_above} rows", kept_text)
        return served
    log.info("GGUF weights served natively on CPU (no bf16 copy): %s; Q4 blocks through int4 (group 32, bf16 "
             "scales), Q8_0 requantized per row to int8%s; kept dequantized: %s", served_text,
             "" if dense_above is None else f"; a packed bf16 twin serves steps of more than {dense_above} rows",
             kept_text)
    return served
