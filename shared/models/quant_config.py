"""A checkpoint's `quantization_config` (config.json), read into what the loader serves, or refused at start.

Servable:
- AWQ (AutoAWQ's GEMM format): 4 bits, zero point, group 32/64/128;
- GPTQ (AutoGPTQ / GPTQModel, checkpoint_format gptq or gptq_v2): 4 bits, symmetric or not, group 32/64/128, with or
  without desc_act (g_idx);
- FP8 as vLLM reads it (`quant_method: fp8`, per-tensor weight scales, static or dynamic activation scales) and
  compressed-tensors `float-quantized` (8-bit float weights per tensor or per channel, activations per token
  (dynamic) or per tensor (static)).

Anything else (another method, bit width, group, block-wise FP8 scales, weight-only FP8) is a CheckpointError that
says what the checkpoint is and what is supported. No torch here: the GPU plan (shared/launcher/gpu_plan.py) sizes
quantized weights from this without importing it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.models.errors import CheckpointError

W4_GROUPS = (32, 64, 128)
SUPPORTED = "awq (4-bit GEMM, zero point), gptq (4-bit, groups 32/64/128), fp8 / compressed-tensors float-quantized"
# --quantization values that mean "serve this checkpoint's own format" (fp8 also quantizes an unquantized one).
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "awq", "gptq" or "fp8"
    group: int = 0  # 4-bit: input rows per scale
    sym: bool = False  # GPTQ: symmetric (the zero is 8)
    desc_act: bool = False  # GPTQ: rows in activation order (g_idx)
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    fp8_static_input: bool = False  # FP8: a static input_scale per layer (else per token, dynamic)
    fp8_weight_per_channel: bool = False  # FP8: weight_scale [N] (else one per tensor)
    fmt: str = ""  # the config's own words, for messages ("compressed-tensors float-quantized", ...)


def _bad(path: Path, field: str, what: str) -> CheckpointError:
    return CheckpointError(path, f"quantization_config.{field}", f"{what}; supported: {SUPPORTED}")


def _w4(qc: dict, path: Path, method: str) -> CheckpointQuant:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise _bad(path, "bits", f"{method} with {bits}-bit weights is not servable (4-bit only)")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if group not in W4_GROUPS:
        raise _bad(path, "group_size", f"{method} group size {group} is not one the 4-bit kernel has "
                                       f"({', '.join(map(str, W4_GROUPS))})")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _bad(path, "version", f"AWQ version {version!r} (only AutoAWQ's GEMM packing)")
        if not qc.get("zero_point", True):
            raise _bad(path, "zero_point", "AWQ without zero points")
        return CheckpointQuant("awq", group=group, fmt="awq gemm")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _bad(path, "checkpoint_format", f"GPTQ checkpoint format {fmt!r}")
    return CheckpointQuant("gptq", group=group, sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                           zero_offset=1 if fmt == "gptq" else 0, fmt=f"gptq ({fmt})")


def _vllm_fp8(qc: dict, path: Path) -> CheckpointQuant:
    if qc.get("weight_block_size"):
        raise _bad(path, "weight_block_size", f"block-wise FP8 scales {qc['weight_block_size']}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise _bad(path, "activation_scheme", f"FP8 activation scheme {scheme!r}")
    return CheckpointQuant("fp8", fp8_static_input=scheme == "static", fmt=f"fp8 ({scheme} activations)")


def _compressed_tensors(qc: dict, path: Path) -> CheckpointQuant:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if fmt != "float-quantized":
        raise _bad(path, "format", f"compressed-tensors format {fmt!r} (only float-quantized: FP8)")
    if len(groups) != 1:
        raise _bad(path, "config_groups", f"{len(groups)} compressed-tensors config groups (one FP8 scheme only)")
    (name, group), = groups.items()
    w, a = group.get("weights") or {}, group.get("input_activations")
    where = f"config_groups.{name}"
    if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("tensor", "channel") \
            or w.get("dynamic", False):
        raise _bad(path, f"{where}.weights", f"compressed-tensors weights {w} (8-bit float, per tensor or channel)")
    if not a:
        raise _bad(path, f"{where}.input_activations", "FP8 weight-only (no activation quantization)")
    if a.get("num_bits") != 8 or a.get("type") != "float" or (a.get("strategy"), bool(a.get("dynamic"))) not in (
            ("token", True), ("tensor", False), ("tensor", True)):
        raise _bad(path, f"{where}.input_activations", f"compressed-tensors activations {a} (8-bit float, per token "
                                                       "dynamic or per tensor)")
    static = not a.get("dynamic")
    return CheckpointQuant("fp8", fp8_static_input=static, fp8_weight_per_channel=w["strategy"] == "channel",
                           fmt=f"compressed-tensors float-quantized ({w['strategy']} weights, "
                               f"{'static' if static else 'dynamic'} activations)")


def parse_quantization_config(raw: dict, path: Path) -> CheckpointQuant | None:
    """config.json's quantization_config -> what to serve, None when there is none; CheckpointError if unservable."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(path, "quantization_config", f"expected an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return _w4(qc, path, method)
    if method == "fp8":
        return _vllm_fp8(qc, path)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, path)
    raise _bad(path, "quant_method", f"quantization method {method or None!r} is not servable")


def resolve_checkpoint_quantization(requested: str, ckpt: CheckpointQuant | None, model: str) -> str | None:
    """--quantization against the checkpoint's own: awq/gptq/fp8 to serve (fp8 without a quantization_config:
    quantize at load), None to leave the decision to the other modes; ValueError naming both when they disagree."""
    if ckpt is None:
        if requested in ("awq", "gptq"):
            raise ValueError(f"--quantization {requested}: {model} has no quantization_config (not an "
                             f"{requested.upper()} checkpoint); --quantization fp8 quantizes an unquantized one")
        return "fp8" if requested == "fp8" else None
    if requested in ("auto", ckpt.method):
        return ckpt.method
    raise ValueError(f"--quantization {requested}: {model} is a {ckpt.fmt} checkpoint; serve it with "
                     f"--quantization {ckpt.method} (or auto)")


def linear_bytes(method: str | None, k: int, n: int, group: int, elem: int) -> int:
    """Bytes one K x N linear layer's weight takes as served (shared/models/w4a16.py, fp8_linear.py)."""
    if method in ("awq", "gptq"):
        groups = -(-k // group)
        return k * n // 2 + groups * n * (2 + 1)  # 4-bit words, float16 scales, uint8 zeros
    if method == "fp8":
        return k * n + 4 * n  # e4m3 weight, float32 row scales
    return k * n * elem
