"""The engine configuration refuses, at start and with a message saying what to change, what no kernel can
compile: KV blocks under 16 tokens (tl.dot over a block needs K >= 16) and FP8 KV on a GPU below sm_89 (no
float8_e4m3 there: tests/test_kernel_aot_compile.py shows the compiler refusing it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import EngineConfig
from shared.engine.errors import EXIT_CONFIG, ConfigError
from shared.bus.natsd import NatsServer


@pytest.mark.parametrize("block_size", [1, 4, 8, 24])
def test_block_sizes_below_16_or_not_a_power_of_two_are_refused(block_size):
    with pytest.raises(ConfigError, match=rf"block size {block_size}: .*power of 2 >= 16"):
        EngineConfig(model="m", block_size=block_size, device="cpu")
    assert EngineConfig(model="m", block_size=16, device="cpu").block_size == 16


@pytest.mark.parametrize("cap", [(7, 0), (7, 5), (8, 0), (8, 6)])
def test_fp8_kv_is_refused_below_sm89(cap):
    with pytest.raises(ConfigError, match=rf"fp8 needs .*>= 8\.9.*sm_{cap[0]}{cap[1]}.*--kv-cache-dtype auto"):
        EngineConfig(model="m", device="cuda", kv_cache_dtype="fp8", gpu_capability=cap)


@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (10, 0)])
def test_fp8_kv_is_accepted_from_sm89_and_on_cpu(cap):
    assert EngineConfig(model="m", device="cuda", kv_cache_dtype="fp8", gpu_capability=cap).kv_cache_dtype == "fp8"
    assert EngineConfig(model="m", device="cpu", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    EngineConfig(model="m", device="cuda", kv_cache_dtype="auto", gpu_capability=(7, 0))  # bf16/fp16 KV: any GPU


def test_a_decode_worker_with_block_size_8_exits_78_with_the_message(tmp_path: Path, checkpoints):
    with NatsServer(workdir=tmp_path) as nats:
        proc = subprocess.run(
            [sys.executable, "-m", "services.decode", "--model", str(checkpoints["llama"].path), "--nats-url", nats.url,
             "--block-size", "8", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    assert "kvmesh decode: cannot start: block size 8: the KV block size must be a power of 2 >= 16" in proc.stderr
    assert "Traceback" not in proc.stderr
