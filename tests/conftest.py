from __future__ import annotations

import functools
import os

# Triton kernels run on CPU through Triton's interpreter, checked against their torch twins. The variable
# must be set before triton is imported; on a CUDA machine the kernels run for real.
if os.environ.get("KVMESH_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The exactness checks against transformers run in float32; CPUs with native bf16 would otherwise default to
# bfloat16 (shared/models/cpu_dtype.py). Services the tests start inherit it. tests/test_cpu_dtype.py checks
# the default itself.
os.environ.setdefault("KVMESH_CPU_DTYPE", "float32")

# Under pytest-xdist (`make test` runs one worker a core) each worker and every service it starts computes
# with one thread: two OpenMP teams of two threads on two cores spin at each other's barriers and every step
# slows several-fold. A test that wants more threads sets OMP_NUM_THREADS for its own subprocesses.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tests.checkpoints import ARCHS, Checkpoint, build_checkpoint, hf_greedy

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_reference():
    """Memoised transformers greedy output: (arch checkpoint, prompt, max_new) -> (tokens, logprobs)."""

    @functools.lru_cache(maxsize=None)
    def run(ckpt_key: tuple[str, int], prompt: tuple[int, ...], max_new: int):
        return hf_greedy(_models[ckpt_key], list(prompt), max_new)

    _models: dict[tuple[str, int], torch.nn.Module] = {}

    def reference(ckpt: Checkpoint, prompt: list[int], max_new: int):
        key = (ckpt.arch, id(ckpt.hf_model))
        _models[key] = ckpt.hf_model
        return run(key, tuple(prompt), max_new)

    return reference


@pytest.fixture(scope="session")
def smollm2_gguf_file():
    """The SmolLM2-135M-Instruct Q4_1 GGUF file (tests/real_model.py)."""
    from tests.real_model import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf_file):
    """SmolLM2-135M-Instruct as a checkpoint directory, through the same GGUF cache users go through."""
    from tests.real_model import smollm2_checkpoint_dir

    return smollm2_checkpoint_dir()
