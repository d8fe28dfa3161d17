"""What `--model` names: a Hugging Face checkpoint directory, a `.gguf` file, or a directory holding one.

A GGUF is converted once (shared/models/gguf_convert.py) into a checkpoint directory in a cache
keyed by the file's content hash and LOADER_VERSION, so a second start does not dequantize again
and every service of a mesh reads the same directory. The conversion is written to a temporary
directory and renamed into place, and a lock file makes concurrent starts wait for one converter
instead of all converting: a cache entry is complete or absent, never half-written. A cache hit
imports nothing beyond the standard library (the gateway and tokenizer processes stay torch-free).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from shared.models.errors import CheckpointError

# Bump when the conversion's output changes: old cache entries are then ignored.
LOADER_VERSION = 3  # 2: Q4 blocks kept beside the dequantized weights (gguf_blocks.safetensors); 3: Q4_K too
# "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct": the directory name is the default
# served model name, and the quantization is not part of the model's name.
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|BF16|F32)$", re.IGNORECASE)


def cache_root() -> Path:
    env = os.environ.get("KVMESH_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvmesh"


def gguf_file_of(model: str | Path) -> Path | None:
    """The GGUF file `model` names, or None when it is an ordinary checkpoint directory."""
    p = Path(model)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise CheckpointError(p, "file", "GGUF file does not exist")
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise CheckpointError(p, "*.gguf", f"{len(found)} GGUF files; name one: {', '.join(f.name for f in found)}")
        if found:
            return found[0]
    return None


def model_name_of(gguf_path: Path) -> str:
    return _QUANT_SUFFIX.sub("", gguf_path.stem) or "model"


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def resolve_model(model: str | Path, cache_dir: Path | None = None) -> str:
    """A checkpoint directory for `model`: itself, or the cached conversion of the GGUF it names."""
    gguf_path = gguf_file_of(model)
    if gguf_path is None:
        return str(model)
    root = (cache_dir or cache_root()) / "gguf"
    entry = root / f"{file_hash(gguf_path)[:32]}-v{LOADER_VERSION}"
    target = entry / model_name_of(gguf_path)
    if (target / "config.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file: wait for it
        if not (target / "config.json").is_file():
            _convert_into(gguf_path, entry, target.name)
    return str(target)


def _convert_into(gguf_path: Path, entry: Path, name: str) -> None:
    from shared.models.gguf_convert import convert_gguf  # numpy + gguf: only when converting

    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.tmp-", dir=entry.parent))
    try:
        convert_gguf(gguf_path, tmp / name)
        for p in tmp.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)  # other users (containers) read the same cache
        tmp.chmod(0o755)
        if entry.exists():  # a stale, incomplete entry from an older crash cannot exist (rename is atomic)
            shutil.rmtree(entry)
        os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
