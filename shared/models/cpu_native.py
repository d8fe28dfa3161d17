"""The C++ CPU path for small steps (kernels/cpu/): a single-device Llama-family model's decoder stack handed to
C++ once, then each decode step (and each verify or short prompt-chunk step: at most MAX_CHUNK rows per chunk, or
a whole prompt of at most SHORT_PROMPT tokens where its kernels allow) runs all layers in one call instead of ~70
Python-dispatched aten ops per layer.

Default on a CPU device when the extension builds (KVMESH_CPU_KERNELS=torch keeps the Python path). The Python
(eager, torch twin) path stays for: CUDA, tensor parallelism, an FP8 or otherwise non-model-dtype KV cache,
dtypes other than float32/bfloat16, linear layers it does not know, steps with a longer prompt chunk
(its per-row attention loops have no matmul; prefill attention there is the twin's), steps whose Triton
launches are being recorded (kernels/aot.py), and a compiled CPU decode (--cpu-compile: its bucketed decode graphs
run instead of execute_rows).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import AttentionMetadata
from kernels.cpu.decoder_stack import DENSE, DP, GGUF, INT4, INT8, PACKED, W16, DecoderStack
from kernels.cpu.extension import native_status
from kernels.cpu.thread_pool import ENV, use_torch_team
from kernels.triton_support import recording
from shared.models.dp_linear import DpLinear
from shared.models.gguf_quant import RowSplitLinear
from shared.models.packed_linear import PackedLinear
from shared.models.quant_linear import GgufLinear, Int4Linear, Int8Linear, WeightLinear

log = logging.getLogger(__name__)

MAX_CHUNK = 32  # longest prompt chunk (or verify step) of a step the C++ stack runs, whatever the context
# ... and a prompt chunk of any length whose whole context is at most this many tokens (a short prompt, all at
# once): its per-row attention then stays cheap, while the Python path's per-layer dispatch costs ~10 ms a step.
# Measured on a 2-core Zen 5 in bf16, the demo's prefill: 40 / 64 / 96 / 128 tokens 18 / 27 / 39 / 55 ms against
# 28 / 37 / 48 / 63 through Python, 8 prompts of 40 tokens 94 against 122. A last chunk deep into a long prompt
# stays on Python: 112 rows at context 2,160 took 318 ms more in C++. Not for a model whose float32 kernels
# multiply such steps by dequantized tiles on torch's team (GgufLinear past 32 rows, WeightLinear past 64) while
# the rest of the stack is on the kernels' own threads: measured no faster on AVX2 (0.89-1.05x).
SHORT_PROMPT = 128


def _linear(stack: DecoderStack, m: nn.Module) -> int:
    if isinstance(m, RowSplitLinear):
        return stack.split(_linear(stack, m.quantized), _linear(stack, m.dense), m.max_rows)
    if isinstance(m, PackedLinear):
        return stack.linear(PACKED, m.packed, bias=m.bias)
    if isinstance(m, Int4Linear):
        return stack.linear(INT4, m.packed, m.scales_zeros, m.bias, m.group)
    if isinstance(m, Int8Linear):
        return stack.linear(INT8, m.qweight, m.scales, m.bias)
    if isinstance(m, WeightLinear):
        return stack.linear(W16, m.weight16, bias=m.bias)
    if isinstance(m, DpLinear):
        return stack.linear(DP, m.packed, bias=m.bias, group=m.out_features)
    if isinstance(m, GgufLinear):
        return stack.linear(GGUF, m.qs, m.scales, m.bias, m.fmt + 8 * m.act)
    if type(m) is nn.Linear:
        return stack.linear(DENSE, m.weight, bias=m.bias)
    raise TypeError(f"no C++ path for a {type(m).__name__} layer")


class NativeDecode:
    """The model's forward (embedding, decoder stack, final norm) for the steps can_run accepts."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.cfg
        small_only = {id(m.quantized) for m in model.modules() if isinstance(m, RowSplitLinear)}
        tiles = any(isinstance(m, (GgufLinear, WeightLinear)) and id(m) not in small_only for m in model.modules())
        self.short_prompt = MAX_CHUNK if tiles else SHORT_PROMPT
        self.model = model
        self.dtype = model.norm.weight.dtype
        attn0 = model.layers[0].self_attn
        self.stack = DecoderStack(model.norm.weight.detach(), cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, attn0.scale, cfg.sliding_window)
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            assert layer.input_layernorm.eps == layer.post_attention_layernorm.eps == cfg.rms_norm_eps
            qn, kn = (a.q_norm.weight.detach(), a.k_norm.weight.detach()) if cfg.qk_norm else (None, None)
            self.stack.layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                             qn, kn, _linear(self.stack, a.qkv_proj), _linear(self.stack, a.o_proj),
                             _linear(self.stack, mlp.gate_up_proj), _linear(self.stack, mlp.down_proj))

    @property
    def calls(self) -> int:
        return self.stack.calls

    def can_run(self, meta: AttentionMetadata, kv_caches) -> bool:  # noqa: ANN001
        k = kv_caches[0][0]  # an FP8 cache (scales, dequantization) stays on the twin
        # recording(): kernels/aot.py records the Triton launches a step would make, which only the Python path does.
        if meta.max_prefill_query_len > MAX_CHUNK and (meta.max_prefill_query_len > self.short_prompt or
                                                        int(meta.prefill_context_lens.max()) > self.short_prompt):
            return False
        return k.dtype == self.dtype and k.device.type == "cpu" and not recording()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches) -> torch.Tensor:  # noqa: ANN001
        x = self.model.embed_tokens(input_ids)
        return self.stack.run(x, positions, self.model.cos_sin, meta, kv_caches)


# Linear layers whose matmuls the C++ kernels run on their own threads; every other kind is torch's op on its
# OpenMP team.
OWN_THREAD_LINEARS = (WeightLinear, GgufLinear, DpLinear)


def choose_kernel_threads(model: nn.Module) -> str:
    """Point the C++ kernels' loops at the threads that run the model's matmuls (kernels/cpu/thread_pool.py):
    their own when every linear layer, the head included, is one of theirs, else torch's team. Returns the line to
    log."""
    ours = any(isinstance(m, OWN_THREAD_LINEARS) for m in model.modules())
    theirs = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, (nn.Linear, PackedLinear, Int4Linear, Int8Linear))})
    want_team = bool(theirs) or not ours
    on_team = use_torch_team(want_team)
    where = "torch's OpenMP team" if on_team else "their own threads"
    why = (f"{ENV} is set" if on_team != want_team else
           f"the matmuls are torch's ({', '.join(theirs)})" if theirs else
           "no linear layer is one of the kernels'" if not ours else "the matmuls are these kernels too")
    return f"C++ kernels' loops on {where}: {why}"


def native_decode_for(model: nn.Module, device: str) -> tuple[NativeDecode | None, str]:
    """(the C++ stack for this model, or None; why / which path), for a ModelRunner on device."""
    if device != "cpu":
        return None, f"not a CPU device ({device})"
    if getattr(model, "tp", None) is not None:
        return None, "tensor parallelism"
    dtype = model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"{dtype} (float32 and bfloat16 only)"
    if model.cos_sin.dtype != torch.float32:
        return None, f"a {model.cos_sin.dtype} rotary table"
    ok, why = native_status()
    if not ok:
        return None, why
    try:
        native = NativeDecode(model)
    except (TypeError, AssertionError) as e:
        return None, str(e) or type(e).__name__
    return native, why
