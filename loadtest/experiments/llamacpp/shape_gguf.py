"""A larger model for the llama.cpp comparison: a real architecture (Qwen3-0.6B, Llama-3.2-1B) with random weights,
written as a Hugging Face checkpoint with transformers' own classes, then as GGUF files by llama.cpp's own converter
(`convert_hf_to_gguf.py`, bf16) and, from that bf16 file, a Q4_0/Q4_1 one (gguf's reference quantizer, the layout
SmolLM2's published Q4_1 file has: matrices in the 4-bit type, the token embedding in Q8_0, norms in F32). Both
servers then load the very same file.

No tokenizer comes with random weights: the shape takes SmolLM2's (vocabulary 49,152, its chat template and its
special tokens), so prompts, chat templates and token counts are the demo's. Everything is cached by shape.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def shape_checkpoint(name: str, out: Path) -> Path:
    """The shape's random-weights checkpoint with SmolLM2's tokenizer, in `out` (kept when already there)."""
    from loadtest.shapes import SHAPES, build_shape_checkpoint
    from shared.models.smollm2 import smollm2_checkpoint

    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    base = SHAPES[name]
    shape = replace(base, config=base.config | {"vocab_size": SMOLLM2_VOCAB, "bos_token_id": 1, "eos_token_id": 2})
    build_shape_checkpoint(str(out), shape)
    smol = smollm2_checkpoint()
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy(smol / f, out / f)
    return out


def convert_bf16(checkpoint: Path, tree: Path, out: Path) -> Path:
    """llama.cpp's converter (its own gguf-py on the path), bf16 out."""
    if not out.exists():
        env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def quantize_gguf(src: Path, out: Path, qtype: str = "Q4_0") -> Path:
    """`src` (a bf16/f32 GGUF) with its matrices in `qtype` (Q4_0 or Q4_1), token_embd in Q8_0, the rest as is."""
    import gguf
    import numpy as np

    if out.exists():
        return out
    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    for t in reader.tensors:
        kind = target if t.name != "token_embd.weight" else gguf.GGMLQuantizationType.Q8_0
        if t.tensor_type in (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16,
                             gguf.GGMLQuantizationType.F32) and len(t.shape) == 2 and "norm" not in t.name:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".part", out)
    return out


def shape_ggufs(name: str, tree: Path, cache: Path, qtype: str = "Q4_0") -> tuple[Path, Path, Path]:
    """(checkpoint dir, bf16 GGUF, 4-bit GGUF) of the shape, built once into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = shape_checkpoint(name, cache / f"{name}-random")
    bf16 = convert_bf16(ckpt, tree, cache / f"{name}-random-bf16.gguf")
    return ckpt, bf16, quantize_gguf(bf16, cache / f"{name}-random-{qtype.lower()}.gguf", qtype)
