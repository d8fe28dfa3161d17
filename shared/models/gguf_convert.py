"""Turn one GGUF file into an ordinary Hugging Face checkpoint directory.

Everything kvmesh loads (weights, config, tokenizer, chat template, generation defaults) is then
the same files a Hugging Face checkpoint has, so the loader, the tokenizer service and the gateway
need no GGUF code of their own. The file is read with the `gguf` package; weights are dequantized
with its numpy dequantizer (it covers every type and keeps conversion torch-free; about 1 s for
SmolLM2's Q4_1 tensors, paid once per file, where a torch dequantizer would save 0.8 s)
and written as float32 safetensors: dequantized values are exact in float32, and the engine rounds them to the
serving dtype at load. Q4_0/Q4_1/Q4_K and Q6_K blocks are also kept as stored (shared/models/gguf_blocks.py),
for CPU workers that serve them without dequantizing. This module imports numpy and gguf, never torch; the tokenizer comes through
transformers' GGUF tokenizer conversion (tokenizers only).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.models.errors import CheckpointError

# GGUF architecture -> (HF model_type, HF architecture class). Mistral GGUFs written by llama.cpp
# say "llama"; "mistral" is accepted for files that name it.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's converter permutes the q/k rows of llama-architecture checkpoints (its rope pairs
# adjacent dims; HF's pairs halves). Undone here exactly as transformers' GGUF loader does.
PERMUTED_ARCHS = {"llama"}

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GgufHeader:
    """What the conversion needs from the metadata, read before any tensor data."""

    arch: str
    config: dict
    generation: dict


def _field(reader, path: Path, key: str, default: object = ...) -> object:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise CheckpointError(path, key, "required metadata field missing")
        return default
    return f.contents()


def read_header(reader, path: Path) -> GgufHeader:
    arch = _field(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(path, "general.architecture",
                              f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    model_type, cls = ARCHITECTURES[arch]
    get = lambda key, default=...: _field(reader, path, f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(path, "rope_freqs.weight", "per-dimension rope frequencies (llama3 rope scaling) are not supported")
    if get("rope.scaling.type", None) not in (None, "none"):
        raise CheckpointError(path, f"{arch}.rope.scaling.type", "rope scaling is not supported")
    vocab = int(get("vocab_size", len(_field(reader, path, "tokenizer.ggml.tokens"))))
    bos = _field(reader, path, "tokenizer.ggml.bos_token_id", None)
    eos = _field(reader, path, "tokenizer.ggml.eos_token_id", None)
    pad = _field(reader, path, "tokenizer.ggml.padding_token_id", None)
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        # float32 files, served in bf16 on GPUs (float32 on CPU, as for any checkpoint).
        "dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)) if v is not None}
    return GgufHeader(arch=arch, config=config, generation=generation)


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def dequantized_tensors(reader, path: Path, header: GgufHeader) -> dict[str, np.ndarray]:
    """Every tensor as float32 under its HF name; every type and name is checked before any is dequantized."""
    from gguf.quants import dequantize

    plan = []
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(path, t.name, f"tensor type {t.tensor_type.name} is not supported; "
                                                f"supported: {', '.join(SUPPORTED_TYPES)}")
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(path, t.name, f"tensor not understood for architecture {header.arch}")
        plan.append((t, name))
    heads, kv_heads = header.config["num_attention_heads"], header.config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for t, name in plan:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        if header.arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _reverse_permute(w, heads)
        elif header.arch in PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _reverse_permute(w, kv_heads)
        out[name] = np.ascontiguousarray(w)
    return out


def q4_block_tensors(reader, header: GgufHeader) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The Q4_0/Q4_1/Q4_K tensors' blocks under their HF names (shared/models/gguf_blocks.py: `<name>.codes`, `.d`,
    `.m`) and the Q6_K tensors' (`.codes` int8, `.d` per 16), q/k rows un-permuted as the dequantized weights are,
    and every tensor's GGUF type by HF name."""
    from shared.models.gguf_blocks import NATIVE_Q4, NATIVE_Q8, q4_blocks, q6_k_blocks

    heads, kv_heads = header.config["num_attention_heads"], header.config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        types[name] = t.tensor_type.name
        if t.tensor_type.name in NATIVE_Q4:
            parts, suffixes = q4_blocks(np.asarray(t.data), t.tensor_type.name), ("codes", "d", "m")
        elif t.tensor_type.name in NATIVE_Q8:
            parts, suffixes = q6_k_blocks(np.asarray(t.data)), ("codes", "d")
        else:
            continue
        if header.arch in PERMUTED_ARCHS and name.endswith("q_proj.weight"):
            parts = tuple(_reverse_permute(a, heads) for a in parts)
        elif header.arch in PERMUTED_ARCHS and name.endswith("k_proj.weight"):
            parts = tuple(_reverse_permute(a, kv_heads) for a in parts)
        for suffix, a in zip(suffixes, parts):
            out[f"{name}.{suffix}"] = np.ascontiguousarray(a)
    return out, types


def convert_gguf(path: Path, out_dir: Path) -> Path:
    """Write config.json, generation_config.json, model.safetensors, the Q4 blocks (gguf_blocks.safetensors,
    for serving them natively on CPU: shared/models/gguf_quant.py) and the tokenizer files into out_dir."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise CheckpointError(path, "header", f"not a readable GGUF file: {e}") from None
    header = read_header(reader, path)
    tensors = dequantized_tensors(reader, path, header)
    if header.config["tie_word_embeddings"] is False and "lm_head.weight" not in tensors:
        raise CheckpointError(path, "output.weight", "missing")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    del tensors
    from shared.models.gguf_blocks import BLOCKS_FILE, blocks_metadata

    blocks, types = q4_block_tensors(reader, header)
    if blocks or "Q8_0" in types.values():
        save_file(blocks, str(out_dir / BLOCKS_FILE), metadata=blocks_metadata(types))
    (out_dir / "config.json").write_text(json.dumps(header.config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(header.generation, indent=2) + "\n")
    return out_dir


def _write_tokenizer(path: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, through transformers' GGUF tokenizer conversion."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean the same here
        raise CheckpointError(path, "tokenizer.ggml.model", f"tokenizer could not be converted: {e}") from None
    tok.save_pretrained(str(out_dir))
