"""Serve a GGUF's quantized weights on CPU without dequantizing them to bf16 (`--quantization gguf`; `gguf-hybrid`,
the default for a converted GGUF served in bf16 on a CPU, also keeps a bf16 twin for steps of more than 4 rows;
`--quantization none` serves the dequantized weights).

- Q4_0 / Q4_1 linear layers become Int4Linear (shared/models/quant_linear.py, torch's
  `aten._weight_int4pack_mm_for_cpu`, group 32) from the file's own blocks (shared/models/gguf_blocks.py): the
  same 4-bit codes, and per block scale = d and zero = m + 8 d (Q4_1) or 0 (Q4_0), which the kernel takes in
  bf16 when the activations are bf16. fp16 d rounded to bf16 moves each weight by at most 8 |d| 2^-9 (plus
  |m + 8 d| 2^-9 for Q4_1); bf16 dequantized weights are themselves rounded by up to |w| 2^-9, so the two are
  about as far from the exact dequantization (measured: perplexity +0.4% against the bf16 ones).
- Q8_0 linear layers (and SmolLM2's Q8_0 output head, tied to the embeddings) become Int8Linear: torch's int8
  kernel has one scale per row, not per 32 values, so the exact dequantized rows are requantized per row
  (max |w| / 127). That is not the file's rounding; its error is measured beside the Q4 one.
- Everything else (F32/F16/BF16, Q5 and K-quants) keeps the dequantized weights in the model dtype; embeddings
  and norms always do. A fused layer (q/k/v, gate/up) goes native only when all its parts are Q4_0/Q4_1, or all Q8_0.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.models.gguf_blocks import BLOCKS_FILE, NATIVE_Q4
from shared.models.quant_linear import Int4Linear, Int8Linear

log = logging.getLogger(__name__)

# gguf: the quantized layers only. gguf-hybrid: each also keeps the dequantized weight, packed bf16, for steps of
# more than HYBRID_MAX_ROWS rows, where torch's int4/int8 CPU kernels (which unpack the weight again for every
# few rows) are slower than oneDNN's bf16 matmul (0.6-0.97x at 8-32 rows): 1.25x bf16's memory.
GGUF_MODES = ("gguf", "gguf-hybrid")
HYBRID_MAX_ROWS = 4
# What --quantization auto serves a GGUF as: hybrid, because pure int4 measured 0.58-0.67x of bf16 at batch 32 and
# every prefill chunk (tens of rows) would go through the slow path too; gguf when memory matters more.
AUTO_MODE = "gguf-hybrid"


class RowSplitLinear(nn.Module):
    """A quantized layer for steps of at most max_rows rows, its dense twin for larger ones."""

    def __init__(self, quantized: nn.Module, dense: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.quantized, self.dense, self.max_rows = quantized, dense, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.quantized(x) if rows <= self.max_rows else self.dense(x)


def _with_dense(new: nn.Module, old: nn.Linear, max_rows: int | None) -> nn.Module:
    if max_rows is None:
        return new
    from shared.models.packed_linear import PackedLinear, packing_available

    dense = PackedLinear(old.weight, old.bias) if packing_available() and old.weight.dtype == torch.bfloat16 else old
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
    (not dummy ones)."""
    from shared.engine.errors import ConfigError
    from shared.models.cpu_dtype import default_cpu_dtype

    if requested == "none":
        return None
    mode = requested if requested in GGUF_MODES else AUTO_MODE
    blocks = load_format != "dummy" and has_gguf_blocks(model)
    served = default_cpu_dtype()[0] if dtype == "auto" and device == "cpu" else dtype
    why = ("not a converted GGUF with Q4_0/Q4_1/Q8_0 weights" if not blocks
           else f"not a CPU device ({device})" if device != "cpu"
           else f"serving {served}, and the native kernels compute in bfloat16" if served != "bfloat16"
           else "tensor parallelism" if tensor_parallel_size > 1 else None)
    if requested in GGUF_MODES and why is not None:
        raise ConfigError(f"--quantization {requested} serves a GGUF's quantized weights natively on one CPU worker in "
                          f"bfloat16; here: {why}")
    if why is not None:
        if blocks:
            log.info("GGUF weights dequantized (--quantization auto: %s)", why)
        return None
    log.info("GGUF weights served as stored (--quantization %s -> %s; --quantization none dequantizes them)",
             requested, mode)
    return mode


def gguf_types(model_dir: str | Path) -> dict[str, str]:
    with safe_open(str(Path(model_dir) / BLOCKS_FILE), framework="pt") as f:
        return json.loads(f.metadata()["gguf_types"])


def _unpack(pairs: torch.Tensor) -> torch.Tensor:
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).view(pairs.shape[0], -1)


def _native(layer: nn.Module, names: list[str], types: dict[str, str], f) -> nn.Module | None:  # noqa: ANN001
    kinds = {types.get(n) for n in names}
    if kinds <= set(NATIVE_Q4):  # Q4_0 and Q4_1 parts mix: both are codes, scale and minimum per 32
        q = torch.cat([_unpack(f.get_tensor(f"{n}.codes")) for n in names])
        d = torch.cat([f.get_tensor(f"{n}.d") for n in names])
        m = torch.cat([f.get_tensor(f"{n}.m") for n in names])
        return Int4Linear.from_blocks(q, d, m, layer.bias)
    if kinds == {"Q8_0"}:
        return Int8Linear(layer.weight, layer.bias)
    return None


@torch.no_grad()
def apply_gguf_blocks(model: nn.Module, model_dir: str | Path, tie_word_embeddings: bool,
                      dense_above: int | None = None) -> Counter:
    """Replace the model's linear layers whose GGUF type has a native kernel, in place (dense_above: keep a bf16
    twin for steps of more rows, RowSplitLinear); returns weights (elements)
    served natively per GGUF type (a fused layer of mixed Q4 parts counts as "Q4_0+Q4_1")."""
    types = gguf_types(model_dir)
    served: Counter = Counter()
    kept: Counter = Counter()  # the same for layers left dequantized
    with safe_open(str(Path(model_dir) / BLOCKS_FILE), framework="pt") as f:
        for i, layer in enumerate(model.layers):
            for (parent_name, name), parts in _PARTS.items():
                parent = getattr(layer, parent_name)
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                old = getattr(parent, name)
                new = _native(old, names, types, f)
                if new is not None:
                    setattr(parent, name, _with_dense(new, old, dense_above))
                (kept if new is None else served)["+".join(sorted({types[n] for n in names}))] += old.weight.numel()
        head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
        new = _native(model.lm_head, [head], types, f)
        if new is not None:
            served[types[head]] += model.lm_head.weight.numel()
            model.lm_head = _with_dense(new, model.lm_head, dense_above)
    log.info("GGUF weights served natively on CPU (no bf16 copy): %s; Q4 blocks through int4 (group 32, bf16 "
             "scales), Q8_0 requantized per row to int8%s; kept dequantized: %s",
             ", ".join(f"{t} {n / 1e6:.1f} M" for t, n in sorted(served.items())) or "none",
             "" if dense_above is None else f"; a packed bf16 twin serves steps of more than {dense_above} rows",
             ", ".join(f"{t} {n / 1e6:.1f} M" for t, n in sorted(kept.items())) or "nothing")
    return served
