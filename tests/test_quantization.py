"""Weight-only int8/int4 linear layers on CPU (shared/models/quant_linear.py): each layer against the weights it
says it multiplies by, Q4_1-style weights requantized exactly, and the quantized engine against transformers
running those very weights; the flag through the worker's arguments; quantized KV never shares a block hash
with full-precision KV."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.models.quant_linear import INT4_GROUP, Int4Linear, Int8Linear, quantize_linear
from shared.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import make_engine, random_prompts


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_multiplies_by_the_weights_it_reports(cls, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    layer = cls(w, b)
    x = torch.randn(2, 5, 128, generator=g).to(dtype)
    want = (x.float() @ layer.dequantized().t() + b.float()).to(dtype)
    # The quantized matmuls run in bfloat16 whatever the model's dtype (shared/models/quant_linear.py).
    torch.testing.assert_close(layer(x), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    # The quantization error of each weight is within half a step of its group's (or row's) scale.
    err = (layer.dequantized() - w.float()).abs()
    if cls is Int8Linear:
        step = w.float().abs().amax(1, keepdim=True) / 127
    else:
        grouped = w.float().view(96, -1, INT4_GROUP)
        step = ((grouped.amax(-1) - grouped.amin(-1)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    slack = 1e-2 * w.float().abs().max().item()  # scales are stored in bf16
    assert (err <= step / 2 + slack).all()


def test_q4_1_weights_requantize_to_themselves_and_constant_groups_survive() -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 64, 96
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # every group spans the full range, as llama.cpp's Q4_1 quantizer makes it
    d = torch.rand(n, k // INT4_GROUP, 1, generator=g).half().float() * 0.1
    # Real groups straddle zero (min about -8 steps); a min far from zero relative to the step would make the
    # bf16 zero's rounding larger than the step.
    m = (-d * (7 + torch.rand(n, k // INT4_GROUP, 1, generator=g))).half().float()
    w = (q * d + m).view(n, k)
    w[3, :INT4_GROUP] = 0.25  # a constant group: scale 0
    layer = Int4Linear(w, None)
    # The same codes come back; only the bfloat16 scale and zero round (within about a tenth of a step here).
    err = (layer.dequantized() - w).abs().view(n, -1, INT4_GROUP)
    assert (err <= 0.15 * d + 1e-6).all()
    assert torch.isfinite(layer(torch.randn(1, k))).all()


def test_a_layer_whose_width_is_not_a_group_multiple_stays_as_it_was() -> None:
    odd = nn.Linear(40, 8)
    assert quantize_linear(odd, "int4") is odd
    assert isinstance(quantize_linear(odd, "int8"), Int8Linear)


def _hf_with_weights_of(engine, ckpt) -> nn.Module:
    """transformers' model of the checkpoint, given the weights the quantized engine multiplies by."""
    hf = copy.deepcopy(ckpt.hf_model)
    cfg = engine.model_config
    with torch.no_grad():
        for ours, theirs in zip(engine.model.layers, hf.model.layers):
            qkv = ours.self_attn.qkv_proj.dequantized()
            a = theirs.self_attn
            a.q_proj.weight.copy_(qkv[: cfg.q_size])
            a.k_proj.weight.copy_(qkv[cfg.q_size: cfg.q_size + cfg.kv_size])
            a.v_proj.weight.copy_(qkv[cfg.q_size + cfg.kv_size:])
            a.o_proj.weight.copy_(ours.self_attn.o_proj.dequantized())
            gate_up = ours.mlp.gate_up_proj.dequantized()
            theirs.mlp.gate_proj.weight.copy_(gate_up[: cfg.intermediate_size])
            theirs.mlp.up_proj.weight.copy_(gate_up[cfg.intermediate_size:])
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.dequantized())
        # A new parameter: a tied head gets its own quantized copy, the embeddings stay as they were.
        hf.lm_head.weight = nn.Parameter(engine.model.lm_head.dequantized())
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_engine_equals_transformers_on_the_same_weights(tmp_path, arch, method) -> None:
    """Prompt logprobs of the quantized engine against transformers (float32) multiplying by the dequantized
    weights: equal within what the quantized layers' bfloat16 activations cost. A layer mapped to the wrong
    weights, or a wrong scale, moves them by far more."""
    ckpt = build_checkpoint(arch, tmp_path / arch)
    engine = make_engine(ckpt, quantization=method)
    assert isinstance(engine.model.layers[0].mlp.down_proj, Int8Linear if method == "int8" else Int4Linear)
    hf = _hf_with_weights_of(engine, ckpt)
    full = make_engine(ckpt)  # the float32 model, for scale: how far quantization itself moves the logprobs
    near = far = 0.0
    for prompt in random_prompts([9, 33], seed=3):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        ours = [p.logprob for p in engine.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:]]
        unquantized = [p.logprob for p in full.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:]]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        theirs = logits.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        near = max(near, (torch.tensor(ours) - theirs).abs().max().item())
        far = max(far, (torch.tensor(unquantized) - theirs).abs().max().item())
    assert near < 5e-2 and far > 2 * near, f"{near=} {far=}: the check must tell quantized weights from the originals"
    # Quantization changes the model: its blocks must not be found under the full-precision model's hashes.
    assert engine.block_manager.root != full.block_manager.root


def test_bad_quantization_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="choose one of auto, none, gguf, gguf-hybrid, int8, int4"):
        EngineConfig(model="unused", device="cpu", quantization="int3")
    with pytest.raises(ConfigError, match="for CPU serving"):
        EngineConfig(model="unused", device="cuda", quantization="int4")


def test_the_worker_flag_reaches_the_engine_config() -> None:
    import argparse

    from services.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--model", "m", "--device", "cpu", "--quantization", "int4"])
    assert engine_config_from_args(args).quantization == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--quantization", "fp4"])


def test_kvmesh_up_passes_quantization_to_the_engine_workers_only() -> None:
    from shared.launcher.process_spec import MeshOptions, mesh_services

    args = {s.service: " ".join(s.args) for s in mesh_services(MeshOptions(quantization="int4"))}
    assert all("--quantization int4" in args[s] for s in ("prefill", "decode"))
    assert not any("--quantization" in args[s] for s in ("gateway", "tokenizer", "kvstore"))


def test_kvmesh_up_refuses_quantization_on_gpus(capsys, checkpoints) -> None:
    from shared.cli import main

    rc = main(["up", "--dry-run", "--model", str(checkpoints["llama"].path), "--devices", "0",
               "--gpu-memory", "80GiB", "--quantization", "int4"])
    assert rc == 2 and "--devices none" in capsys.readouterr().err
