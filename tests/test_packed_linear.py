"""bf16 linear layers with oneDNN pre-packed weights (shared/models/packed_linear.py): bit-identical to F.linear
at every batch size, the engine in bf16 gives the same tokens and logprobs packed and unpacked, float32 and
quantized layers are left alone, and the flag reaches the engine."""
from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from shared.models.dp_linear import ENV
from shared.models.packed_linear import PackedLinear, pack_model, packing_available
from shared.models.quant_linear import Int8Linear
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import greedy, make_engine, random_prompts

needs_onednn_bf16 = pytest.mark.skipif(not packing_available(), reason="this CPU/torch has no oneDNN bf16")


@pytest.fixture(autouse=True)
def _onednn(monkeypatch) -> None:
    """oneDNN's matmul even where the kernels' own AVX512-BF16 one would be chosen (tests/test_cpu_dpbf16.py)."""
    monkeypatch.setenv(ENV, "onednn")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_is_bit_identical_to_linear_at_every_batch(bias) -> None:
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 96, generator=g))
    packed = PackedLinear(lin.weight, lin.bias)
    for rows in (1, 3, 8, 33, 300):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        assert torch.equal(packed(x), lin(x)), rows
    x3 = torch.randn(2, 5, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(packed(x3), lin(x3))
    # A non-contiguous input: F.linear then adds the bias after rounding the product (matmul + add), packed
    # layers always fuse it (addmm's rounding), as F.linear does for the 2-D inputs the models pass.
    assert torch.equal(packed(x3.transpose(0, 1)), lin(x3.transpose(0, 1).contiguous()))
    with pytest.raises(TypeError, match="bf16 activations"):
        packed(x.float())
    with pytest.raises(ValueError, match="bf16 CPU weights"):
        PackedLinear(lin.weight.float(), None)


@needs_onednn_bf16
def test_pack_model_swaps_plain_bf16_linears_only() -> None:
    model = nn.Sequential(nn.Linear(32, 32).to(torch.bfloat16), nn.Linear(32, 32), Int8Linear(torch.randn(32, 32), None))
    assert pack_model(model) == 32 * 32
    assert isinstance(model[0], PackedLinear)
    assert type(model[1]) is nn.Linear  # float32 stays: its tokens are compared with transformers
    assert isinstance(model[2], Int8Linear)


@needs_onednn_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_tokens_and_logprobs_are_the_same_packed_and_unpacked(tmp_path, arch) -> None:
    ckpt = build_checkpoint(arch, tmp_path / arch)
    packed = make_engine(ckpt, dtype="bfloat16")
    plain = make_engine(ckpt, dtype="bfloat16", cpu_weight_packing=False)
    assert isinstance(packed.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert type(plain.model.layers[0].mlp.down_proj) is nn.Linear
    prompts = random_prompts([5, 17, 40], seed=4)
    a = packed.generate(prompts, greedy(12), use_tqdm=False)
    b = plain.generate(prompts, greedy(12), use_tqdm=False)
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]


def test_float32_engines_are_not_packed(tmp_path) -> None:
    ckpt = build_checkpoint("llama", tmp_path / "llama")
    engine = make_engine(ckpt, dtype="float32")
    assert type(engine.model.layers[0].self_attn.qkv_proj) is nn.Linear


def test_the_worker_flag_turns_packing_off() -> None:
    from services.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config_from_args(p.parse_args(["--model", "m", "--device", "cpu"])).cpu_weight_packing
    off = p.parse_args(["--model", "m", "--device", "cpu", "--no-cpu-weight-packing"])
    assert not engine_config_from_args(off).cpu_weight_packing
