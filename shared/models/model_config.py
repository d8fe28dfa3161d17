"""The parts of a Hugging Face config.json that the model code needs, normalised.

Reads both transformers 4.x style (`rope_theta` and `rope_scaling` at the top level) and
5.x style (`rope_parameters`), so checkpoints saved by either load the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.models.errors import CheckpointError
from shared.models.quant_config import CheckpointQuant, parse_quantization_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: str
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # The checkpoint's own quantized format (shared/models/quant_config.py); None: unquantized weights.
    quant: CheckpointQuant | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(raw: dict, path: Path) -> RopeConfig:
    params = raw.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        where = "rope_scaling"
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
    if not isinstance(params, dict):
        raise CheckpointError(path, where, f"expected an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(path, f"{where}.rope_type", f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(params.get("rope_theta", defaults.theta)),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _require(raw: dict, key: str, path: Path) -> int:
    if key not in raw:
        raise CheckpointError(path, key, "missing")
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(path, key, f"expected a positive integer, got {value!r}")
    return value


def _eos_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        eos = gen.get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _sliding_window(arch: str, raw: dict) -> int | None:
    window = raw.get("sliding_window")
    # Qwen2/3 carry a sliding_window value but only apply it when use_sliding_window is set.
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise CheckpointError(path, "config.json", "file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(path, "config.json", f"invalid JSON: {e}") from None
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if isinstance(arch, str) and arch.endswith("ForSequenceClassification"):
        # A classifier is its causal LM's body with a score head instead of lm_head (shared/models/llama_pooling.py).
        arch = arch.removesuffix("ForSequenceClassification") + "ForCausalLM"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            path, "architectures", f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _require(raw, "hidden_size", path)
    heads = _require(raw, "num_attention_heads", path)
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise CheckpointError(path, "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    dtype = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype not in CONFIG_DTYPES:
        raise CheckpointError(path, "dtype", f"unknown dtype {dtype!r}; supported: {', '.join(CONFIG_DTYPES)}")
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=_require(raw, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", path),
        num_layers=_require(raw, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and no o bias; Llama/Qwen3 follow attention_bias for all four.
        qkv_bias=arch == "Qwen2ForCausalLM" or bias,
        o_bias=arch != "Qwen2ForCausalLM" and bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(arch, raw),
        dtype=dtype,
        eos_token_ids=_eos_ids(model_dir, raw),
        bos_token_id=raw.get("bos_token_id"),
        quant=parse_quantization_config(raw, path),
    )
