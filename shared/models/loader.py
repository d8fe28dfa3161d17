"""Load a Hugging Face checkpoint directory into the model, or fail with one clear error.

Every header is validated (shards present, dtypes known, shapes right, nothing missing) before
any tensor data is read, and the model object is returned only when all of it loaded.
"""
from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.models.errors import CheckpointError
from shared.models.llama import LlamaFamilyForCausalLM
from shared.models.cpu_dtype import default_cpu_dtype, float32_for_lack_of_bf16
from shared.models.model_config import ModelConfig, load_model_config
from shared.models.tp.degree import TPShard, shard_of
from shared.models.tp.group import TPGroup
from shared.models.tp.shard_read import read_shard

log = logging.getLogger(__name__)

SAFETENSORS_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
SAFETENSORS_KNOWN_DTYPES = SAFETENSORS_FLOAT_DTYPES | {
    "BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F8_E4M3", "F8_E5M2",
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, at a row offset (fused weights; the offset within this
    rank's share under tensor parallelism). shape is the checkpoint's (whole) shape; split says how a
    tensor-parallel rank slices it: "rows", "cols", "vocab" (rows, the last share short), "kv_heads" (rows of the
    rank's KV heads, which may be another rank's too) or None (replicated; q/k norms are per head_dim, so too)."""

    param: str
    row_offset: int
    shape: tuple[int, ...]
    split: str | None = None


def weight_plan(cfg: ModelConfig, shard: TPShard | None = None) -> dict[str, Target]:
    """Every checkpoint tensor's target; with a shard, offsets are within that rank's fused parameters."""
    plan: dict[str, Target] = {}
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    # Offsets of the parts of the fused q/k/v and gate/up parameters: one rank holds a share of each part.
    lq, lkv, linter = (q, kv, inter) if shard is None else (shard.q_size, shard.kv_size, shard.intermediate_size)
    plan["model.embed_tokens.weight"] = Target("embed_tokens.weight", 0, (cfg.vocab_size, h), "vocab")
    plan["model.norm.weight"] = Target("norm.weight", 0, (h,))
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Target("lm_head.weight", 0, (cfg.vocab_size, h), "vocab")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        plan[f"{src}.input_layernorm.weight"] = Target(f"{dst}.input_layernorm.weight", 0, (h,))
        plan[f"{src}.post_attention_layernorm.weight"] = Target(f"{dst}.post_attention_layernorm.weight", 0, (h,))
        # k/v rows go by KV head, not evenly by rank: above the KV heads' count a head is on several ranks.
        for name, off, rows, split in (("q_proj", 0, q, "rows"), ("k_proj", lq, kv, "kv_heads"),
                                       ("v_proj", lq + lkv, kv, "kv_heads")):
            plan[f"{src}.self_attn.{name}.weight"] = Target(f"{dst}.self_attn.qkv_proj.weight", off, (rows, h), split)
            if cfg.qkv_bias:
                plan[f"{src}.self_attn.{name}.bias"] = Target(f"{dst}.self_attn.qkv_proj.bias", off, (rows,), split)
        plan[f"{src}.self_attn.o_proj.weight"] = Target(f"{dst}.self_attn.o_proj.weight", 0, (h, q), "cols")
        if cfg.o_bias:
            plan[f"{src}.self_attn.o_proj.bias"] = Target(f"{dst}.self_attn.o_proj.bias", 0, (h,))
        if cfg.qk_norm:
            plan[f"{src}.self_attn.q_norm.weight"] = Target(f"{dst}.self_attn.q_norm.weight", 0, (cfg.head_dim,))
            plan[f"{src}.self_attn.k_norm.weight"] = Target(f"{dst}.self_attn.k_norm.weight", 0, (cfg.head_dim,))
        for name, off in (("gate_proj", 0), ("up_proj", linter)):
            plan[f"{src}.mlp.{name}.weight"] = Target(f"{dst}.mlp.gate_up_proj.weight", off, (inter, h), "rows")
            if cfg.mlp_bias:
                plan[f"{src}.mlp.{name}.bias"] = Target(f"{dst}.mlp.gate_up_proj.bias", off, (inter,), "rows")
        plan[f"{src}.mlp.down_proj.weight"] = Target(f"{dst}.mlp.down_proj.weight", 0, (h, inter), "cols")
        if cfg.mlp_bias:
            plan[f"{src}.mlp.down_proj.bias"] = Target(f"{dst}.mlp.down_proj.bias", 0, (h,))
    return plan


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(index, "weight_map", f"unreadable index: {e}") from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).exists():
                raise CheckpointError(index, "weight_map", f"shard {shard} is listed but the file is missing")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(model_dir, "model.safetensors", "no model.safetensors or model.safetensors.index.json found")


def _read_header(path: Path) -> dict[str, dict]:
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(path, "header", f"not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


def _validate(files: list[Path], plan: dict[str, Target], model_dir: Path,
              claimed: Callable[[str], bool] = lambda name: False) -> dict[str, Path]:
    """Map every planned tensor to its file, checking dtypes and shapes from the headers alone (tensors `claimed`
    by the quantized-linear loader are its to check)."""
    located: dict[str, Path] = {}
    for path in files:
        for name, info in _read_header(path).items():
            dtype = info.get("dtype")
            if dtype not in SAFETENSORS_KNOWN_DTYPES:
                raise CheckpointError(path, name, f"unknown dtype {dtype!r}")
            if name.endswith(IGNORED_SUFFIXES) or claimed(name):
                continue
            target = plan.get(name)
            if target is None:
                log.warning("%s: ignoring unexpected tensor %s", path, name)
                continue
            if dtype not in SAFETENSORS_FLOAT_DTYPES:
                raise CheckpointError(path, name, f"dtype {dtype} is not a floating-point weight dtype")
            shape = tuple(info.get("shape", ()))
            if shape != target.shape:
                raise CheckpointError(path, name, f"shape {list(shape)} does not match the config's {list(target.shape)}")
            located[name] = path
    missing = [n for n in plan if n not in located]
    if missing:
        raise CheckpointError(model_dir, missing[0], f"tensor missing from the checkpoint ({len(missing)} missing in all)")
    return located


def resolve_dtype(requested: str, cfg: ModelConfig, device: str) -> torch.dtype:
    from shared.config import DTYPES

    if requested == "auto":
        if device == "cpu":
            name, why = default_cpu_dtype()
            log.info("dtype %s on CPU (--dtype auto: %s)", name, why)
            return DTYPES[name]
        return DTYPES[cfg.dtype]
    return DTYPES[requested]


def load_model(
    model_dir: str | Path,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    max_positions: int | None = None,
    quantization: str | None = None,
    pack_weights: bool = False,
    tp: TPGroup | None = None,
) -> tuple[LlamaFamilyForCausalLM, ModelConfig]:
    """tp: this process's tensor-parallel rank; with more than one rank it loads only its shard (dummy weights
    are then drawn per shard: random all the same, but not the single-device model's values)."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    shard = shard_of(cfg, tp.rank, tp.size) if tp is not None and tp.size > 1 else None  # raises on a bad degree
    plan = None if load_format == "dummy" else weight_plan(cfg, shard)
    # A quantized checkpoint's linears are read by shared/models/quant_load.py, at their quantized size.
    prequantized = plan is not None and cfg.quant is not None and quantization == cfg.quant.method
    if prequantized:
        from shared.models import quant_load

        plan = {n: t for n, t in plan.items() if not quant_load.is_linear_weight(t.param)}
        qplan = quant_load.inspect(cfg, _shard_files(model_dir))
    located = None if plan is None else _validate(_shard_files(model_dir), plan, model_dir,
                                                  (lambda n: quant_load.claims(n, cfg.quant)) if prequantized
                                                  else (lambda n: False))

    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(cfg, max_positions or cfg.max_position_embeddings, tp)
        if prequantized:
            quant_load.drop_linear_weights(model)
    model = model.to_empty(device=device).to(torch_dtype)
    # The rope table is a computed buffer (to_empty left it uninitialised) and stays float32.
    if cfg.tie_word_embeddings:  # to_empty/to re-create parameters one module at a time, untying them
        model.lm_head.weight = model.embed_tokens.weight
    model.cos_sin = LlamaFamilyForCausalLM.rope_table(cfg, max_positions or cfg.max_position_embeddings).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        if plan is None:
            _init_random(model, seed)
        else:
            by_file: dict[Path, list[str]] = {}
            for name, path in located.items():
                by_file.setdefault(path, []).append(name)
            for path, names in by_file.items():
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in names:
                        t = plan[name]
                        dst = params[t.param]
                        if shard is None:
                            dst[t.row_offset : t.row_offset + t.shape[0]].copy_(f.get_tensor(name))
                        else:
                            part = read_shard(f, name, t.split, t.shape, shard)
                            if t.split == "vocab":  # the last rank's padding rows past the vocabulary
                                dst.zero_()
                            dst[t.row_offset : t.row_offset + part.shape[0]].copy_(part)
    if quantization in ("awq", "gptq", "fp8"):
        from shared.models import quant_load

        if prequantized:
            n = quant_load.load_quantized_linears(model, cfg, qplan, shard, device, torch_dtype)
        elif quantization == "fp8":
            n = quant_load.quantize_fp8_model(model)
        else:  # dummy weights: the random ones rounded to 4 bits in the served layout
            n = quant_load.quantize_w4_model(model, cfg.quant.group if cfg.quant else 128)
        log.info("%s quantized weights: %.1f M", quantization, n / 1e6)
    elif quantization in ("gguf", "gguf-hybrid"):
        from shared.models.gguf_quant import HYBRID_MAX_ROWS, apply_gguf_blocks

        apply_gguf_blocks(model, model_dir, cfg.tie_word_embeddings,
                          HYBRID_MAX_ROWS if quantization == "gguf-hybrid" else None)
    elif quantization:
        from shared.models.quant_linear import quantize_model
        from shared.models.tp.quant import quantize_tp_model

        # A rank quantizes its shards as the whole model's would be (every rank runs this: int8 row scales agree).
        n = (quantize_tp_model if shard is not None else quantize_model)(model, quantization)
        log.info("%s weight-only quantization: %.1f M weights quantized", quantization, n / 1e6)
    elif shard is None and cfg.dtype in ("bfloat16", "float16") and float32_for_lack_of_bf16(dtype, device):
        from kernels.cpu.extension import native_available
        from shared.config import DTYPES
        from shared.models.quant_linear import keep_weights_16bit

        n = keep_weights_16bit(model, DTYPES[cfg.dtype]) if native_available() else 0
        log.info("%s", f"{cfg.dtype} weights kept in {cfg.dtype}, float32 compute (C++ kernels/cpu/gemv_bf16.cpp): "
                 f"{n / 1e6:.1f} M weights" if n else "weights in float32: the C++ CPU kernels are off")
    if pack_weights and device == "cpu" and torch_dtype == torch.bfloat16:
        from shared.models.dp_linear import dp_linear_choice, use_dp_linears
        from shared.models.packed_linear import pack_model, packing_available

        own, why = dp_linear_choice()
        if own:
            n = use_dp_linears(model)
            log.info("bf16 linears on the C++ AVX512-BF16 kernel (kernels/cpu/gemv_dpbf16.cpp; %s): %.1f M weights",
                     why, n / 1e6)
        elif packing_available():
            n = pack_model(model)
            log.info("bf16 linears packed for oneDNN: %.1f M weights", n / 1e6)
        else:
            log.info("bf16 linears not packed: this torch/CPU has no oneDNN bf16")
    model.eval()
    return model, cfg


def _init_random(model: LlamaFamilyForCausalLM, seed: int) -> None:
    """Dummy weights for benchmarking real sizes: normal(0, 0.02) like transformers' init, norms at one."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
