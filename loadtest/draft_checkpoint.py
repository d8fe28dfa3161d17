"""A draft checkpoint cut from its target: the first N decoder layers, the embeddings, final norm and LM head.

SmolLM2-135M has no smaller sibling with its tokenizer on this machine, so `kvmesh bench spec --methods
draft_model` drafts with its first layers (early-exit drafting, as LayerSkip's self-speculation does, here as
a separate checkpoint with its own KV). The result is an ordinary Hugging Face directory: the same loader reads it.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncated_checkpoint(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """dst holds src's first num_layers layers (rebuilt only when its config is missing)."""
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"{src} has {config['num_hidden_layers']} layers, asked for {num_layers}")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                m = LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = st.get_tensor(name)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")) and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
