"""Decode steps on CPU through torch.compile (inductor's C++ backend): the CPU counterpart of CUDA graphs.

An eager CPU decode step dispatches about 280 aten ops per decoder layer (views, casts, the norms' and rotary's
elementwise ops, the KV store, attention, four matmuls): at batch 1 on SmolLM2-135M that is ~8,300 ops and most
of the step (a profile of the eager step). Compiled, a layer is about ten calls: fused C++ loops for
the norms, residual adds, rotary and SiLU*mul, the packed oneDNN matmuls and the attention twin as opaque ops
(shared/models/packed_linear.py, kernels/store_kv.py, kernels/decode_attention.py).

One decoder layer's forward is compiled once and reused by every layer (torch's "regional compilation": the
layers differ only in their weights, which the graph takes as inputs), so compile time does not grow with
depth. The first layer gets a zero residual instead of None so it runs the same graph: x + 0 is exact, so the
numerics are the eager ones. Decode steps use the batch buckets of shared/engine/cuda_graphs.py (a step is
padded to its bucket); every bucket runs once at start (DecodeGraphs.warm_all), before the worker reports
ready, so serving compiles nothing: batch 1 gets a static graph, the second bucket makes torch mark the batch
dimension dynamic, and that one graph serves every larger bucket.
"""
from __future__ import annotations

import logging
import shutil
from typing import Literal

import torch

from kernels import AttentionMetadata
from shared.models.llama import DecoderLayer, LlamaFamilyForCausalLM

log = logging.getLogger(__name__)

CpuCompileMode = Literal["auto", "on", "whole", "off"]
# whole: the whole decode forward (embedding, every layer, final norm) as one graph per bucket instead of one
# layer's graph called per layer: one guard check a step instead of one per layer. An experiment beside "on", not
# picked by auto: on SmolLM2 it compiled for 930 s at start on the loaded 2-core CPU (118 s for "on") and was not
# measurably faster at batch 1.
CPU_COMPILE_MODES = ("auto", "on", "whole", "off")


def cpu_compile_enabled(mode: str, device: str, dtype: torch.dtype, enforce_eager: bool = False) -> tuple[bool, str]:
    """(compile the CPU decode step?, why). auto: on a CPU device serving bfloat16 (the default on CPUs with
    native bf16: shared/models/cpu_dtype.py) when inductor can build C++ (a compiler on PATH). float32 stays
    eager under auto, as it stays unpacked (shared/models/packed_linear.py): it is the mode whose tokens are
    compared with transformers, and fused float32 loops round differently from eager's op-by-op ones. on (or
    whole, the same compiled as one graph a step):
    any CPU dtype (a missing compiler is an error at start); off, or --enforce-eager: eager."""
    if mode not in CPU_COMPILE_MODES:
        raise ValueError(f"unknown cpu_compile {mode!r}; choose one of {', '.join(CPU_COMPILE_MODES)}")
    if device != "cpu":
        return False, f"not a CPU device ({device})"
    if mode == "off" or enforce_eager:
        return False, "--cpu-compile off" if mode == "off" else "--enforce-eager"
    if mode == "auto" and dtype != torch.bfloat16:
        return False, f"--cpu-compile auto compiles bfloat16 only; serving {dtype}"
    compiler = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        if mode in ("on", "whole"):
            raise RuntimeError(f"--cpu-compile {mode} needs a C++ compiler (g++ or clang++) for inductor; none on PATH")
        return False, "no C++ compiler on PATH"
    return True, f"inductor C++ backend ({compiler})"


def _whole_step(model: LlamaFamilyForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches) -> torch.Tensor:  # noqa: ANN001
    return model(input_ids, positions, meta, kv_caches)


def _layer_step(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]):
    return layer(x, residual, positions, cos_sin, meta, kv)


class CompiledDecode:
    """The model's forward for decode-only steps, with each layer through one compiled graph."""

    def __init__(self, model: LlamaFamilyForCausalLM, whole: bool = False) -> None:
        self.model = model
        # fullgraph: a graph break would silently fall back to eager for part of every layer.
        # emulate_precision_casts: fused bf16 ops round where eager rounds (each op's bf16 result), so compiled
        # and eager steps give the same tokens (tests/test_cpu_compile.py) at no measurable cost here.
        options = {"emulate_precision_casts": True}
        self.whole = torch.compile(_whole_step, fullgraph=True, options=options) if whole else None
        self.layer = None if whole else torch.compile(_layer_step, fullgraph=True, options=options)
        self.calls = 0  # forwards run (tests check decode steps come through here)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches) -> torch.Tensor:
        self.calls += 1
        m = self.model
        if self.whole is not None:
            return self.whole(m, input_ids, positions, meta, kv_caches)
        x = m.embed_tokens(input_ids)
        residual = torch.zeros_like(x)
        for layer, kv in zip(m.layers, kv_caches):
            x, residual = self.layer(layer, x, residual, positions, m.cos_sin, meta, kv)
        return m.norm(x, residual)[0]


def compile_cpu_decode(runner, model: LlamaFamilyForCausalLM, c, dtype: torch.dtype,  # noqa: ANN001
                       max_model_len: int) -> list[tuple[int, float]]:
    """Compile and warm every decode bucket of the runner when config c's --cpu-compile asks for it on this
    device and dtype (runner: shared/engine/model_runner.py's ModelRunner; c: an EngineConfig). Returns
    (bucket, seconds of its first step) per bucket; [] when decode stays eager."""
    compile_on, why = cpu_compile_enabled(c.cpu_compile, c.device, dtype, c.enforce_eager)
    if not compile_on:
        if c.device == "cpu":
            log.info("CPU decode eager: %s", why)
        return []
    graphs = runner.use_decode_graphs(max_model_len, c.max_num_seqs, capture=False,
                                      forward=CompiledDecode(model, whole=c.cpu_compile == "whole"))
    seconds = graphs.warm_all()
    log.info("CPU decode compiled (%s) for batch buckets %s in %.1f s (per bucket: %s)", why, graphs.buckets,
             sum(s for _, s in seconds), ", ".join(f"{b}: {s:.1f}" for b, s in seconds))
    return seconds
