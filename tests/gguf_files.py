"""Small GGUF files written with the `gguf` package's GGUFWriter, for the GGUF loader's tests.

The tokenizer metadata is SmolLM2's (copied from the real GGUF), so transformers' GGUF support can
load these files too and serve as the independent oracle. Tensor types the gguf package cannot
quantize (the K-quants) are written as raw blocks: random quants with a sane fp16 scale.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")
T = gguf.GGMLQuantizationType


@dataclass
class TinySpec:
    arch: str = "llama"
    hidden: int = 256  # K-quant blocks are 256 wide
    inter: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    # tensor-name suffix -> type; everything else F32 (norms) or F16 (embeddings)
    types: dict[str, str] = field(default_factory=dict)
    default_type: str = "Q8_0"
    # SmolLM2's first `vocab` tokens (ids keep their meaning) and the merges among them: a BPE tokenizer
    # transformers converts and loads as it does the full one, at a fraction of the parse and conversion time.
    vocab: int = 8192


def _raw_k_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype == T.Q6_K:
        raw[..., size - 2:] = scale  # ql, qh, scales, then d
    else:
        raw[..., 0:2] = scale  # d, dmin first
        raw[..., 2:4] = scale
    return raw.reshape(rows, cols // block * size)


def _tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, type_name: str, rng: np.random.Generator) -> None:
    qtype = T[type_name]
    if type_name == "F32":
        w.add_tensor(name, arr.astype(np.float32))
    elif type_name == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    elif type_name in ("Q4_K", "Q5_K", "Q6_K"):
        w.add_tensor(name, _raw_k_blocks(*arr.shape, qtype, rng), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source_gguf: str) -> dict[str, tuple]:
    """The source's tokenizer fields as (value, type, sub_type), read once: parsing 49k tokens and merges
    takes seconds, and every tiny file of a test run copies the same ones."""
    src = gguf.GGUFReader(source_gguf)
    return {key: (src.fields[key].contents(), src.fields[key].types[0], src.fields[key].types[-1])
            for key in TOKENIZER_KEYS}


@functools.lru_cache(maxsize=4)
def _truncated_tokenizer(source_gguf: str, vocab: int) -> dict[str, tuple]:
    fields = dict(_tokenizer_fields(source_gguf))
    tokens, ttype, sub = fields["tokenizer.ggml.tokens"]
    kept = tokens[:vocab]
    known = set(kept)
    merges, mtype, msub = fields["tokenizer.ggml.merges"]
    pairs = (m.split(" ", 1) for m in merges)
    fields["tokenizer.ggml.merges"] = ([f"{a} {b}" for a, b in pairs if a in known and b in known and a + b in known],
                                       mtype, msub)
    fields["tokenizer.ggml.tokens"] = (kept, ttype, sub)
    types, tt, tsub = fields["tokenizer.ggml.token_type"]
    fields["tokenizer.ggml.token_type"] = (types[:vocab], tt, tsub)
    return fields


def write_tiny_gguf(path: Path, source_gguf: Path, spec: TinySpec, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    fields = _truncated_tokenizer(str(source_gguf), spec.vocab)
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    w = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    head_dim = spec.hidden // spec.heads
    w.add_uint32(f"{a}.block_count", spec.layers)
    w.add_uint32(f"{a}.context_length", 2048)
    w.add_uint32(f"{a}.embedding_length", spec.hidden)
    w.add_uint32(f"{a}.feed_forward_length", spec.inter)
    w.add_uint32(f"{a}.attention.head_count", spec.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.kv_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_uint32(f"{a}.vocab_size", vocab)
    if a == "qwen3":
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
    for key, (v, vtype, sub_type) in fields.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, v, vtype, sub_type=sub_type)
        else:
            w.add_key_value(key, v, vtype)

    def weight(name: str, rows: int, cols: int) -> None:
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        _tensor(w, name, rng.normal(0, 0.08, (rows, cols)), spec.types.get(suffix, spec.default_type), rng)

    _tensor(w, "token_embd.weight", rng.normal(0, 0.5, (vocab, spec.hidden)), "F16", rng)
    _tensor(w, "output_norm.weight", 1 + rng.normal(0, 0.1, spec.hidden), "F32", rng)
    if a == "qwen2":
        _tensor(w, "output.weight", rng.normal(0, 0.05, (vocab, spec.hidden)), "F16", rng)
    q, kv = spec.heads * head_dim, spec.kv_heads * head_dim
    for i in range(spec.layers):
        b = f"blk.{i}"
        _tensor(w, f"{b}.attn_norm.weight", 1 + rng.normal(0, 0.1, spec.hidden), "F32", rng)
        _tensor(w, f"{b}.ffn_norm.weight", 1 + rng.normal(0, 0.1, spec.hidden), "F32", rng)
        weight(f"{b}.attn_q.weight", q, spec.hidden)
        weight(f"{b}.attn_k.weight", kv, spec.hidden)
        weight(f"{b}.attn_v.weight", kv, spec.hidden)
        weight(f"{b}.attn_output.weight", spec.hidden, q)
        weight(f"{b}.ffn_gate.weight", spec.inter, spec.hidden)
        weight(f"{b}.ffn_up.weight", spec.inter, spec.hidden)
        weight(f"{b}.ffn_down.weight", spec.hidden, spec.inter)
        if a == "qwen2":
            for n, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                _tensor(w, f"{b}.{n}.bias", rng.normal(0, 0.1, rows), "F32", rng)
        if a == "qwen3":
            _tensor(w, f"{b}.attn_q_norm.weight", 1 + rng.normal(0, 0.1, head_dim), "F32", rng)
            _tensor(w, f"{b}.attn_k_norm.weight", 1 + rng.normal(0, 0.1, head_dim), "F32", rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
