"""The quantized formats against their definitions, without a model: AWQ and GPTQ tensors written here as their
authors pack them (tests/quant_checkpoints.py) and repacked into the kernel's layout dequantize to exactly what the
format defines; a tensor-parallel rank's share is exactly its slice; the FP8 layers quantize and multiply as
stated; the Triton kernels agree with their twins under the interpreter; a quantization_config is served or
refused with a message that names it and what is supported."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import FP8, fp8_gemm_ref, fp8_gemm_triton
from kernels.fp8_quant_rows import quantize_fp8, quantize_fp8_rows_ref, quantize_fp8_static_ref, quantize_fp8_triton
from kernels.w4a16_dequant import w4a16_dequant, w4a16_dequant_ref, w4a16_dequant_triton
from kernels.w4a16_gemm import w4a16_gemm_ref, w4a16_gemm_triton
from kernels.w4a16_layout import pack_rows, unpack_rows
from shared.models import fp8_linear, w4a16
from shared.models.errors import CheckpointError
from shared.models.quant_config import linear_bytes, parse_quantization_config, resolve_checkpoint_quantization
from tests import quant_checkpoints as qc

K, N = 256, 96


def _weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 128])
def test_awq_repacked_dequantizes_exactly_to_the_awq_definition(group) -> None:
    t = qc.awq_tensors(_weight(group), group)
    layout = w4a16.from_awq(t["qweight"], t["qzeros"], t["scales"], group)
    assert torch.equal(layout.dequantized(), qc.dequant_awq(t["qweight"], t["qzeros"], t["scales"], group))
    assert layout.perm is None and layout.g_idx is None


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("sym, v1", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_repacked_dequantizes_exactly_to_the_gptq_definition(group, sym, desc_act, v1) -> None:
    t = qc.gptq_tensors(_weight(group + sym), group, sym, desc_act, v1, seed=group)
    layout = w4a16.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, 1 if v1 else 0)
    want = qc.dequant_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], v1)
    assert torch.equal(layout.dequantized(), want)
    # act order: rows sorted into whole groups, the activations permuted to match; no per-row group index left
    assert (layout.perm is not None) == desc_act and layout.g_idx is None
    # ... and the quantization error is that of a 4-bit grid (the writer is right, not just consistent)
    step = t["scales"].float()[t["g_idx"].long()].t()  # half a step, a whole one where the grid's ends clip
    assert ((want - _weight(group + sym)).abs() <= step * 1.001).all()


def test_the_layer_multiplies_by_the_weights_it_reports() -> None:
    """The twin's product equals x @ dequantized^T (float32: up to summation order), act order included."""
    t = qc.gptq_tensors(_weight(3), 32, False, True, seed=3)
    layer = w4a16.W4A16Linear(w4a16.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32, 1),
                              torch.randn(N))
    x = torch.randn(2, 3, K)
    want = x @ qc.dequant_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]).t() + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_pack_rows_round_trips() -> None:
    q = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_rows(pack_rows(q)), q)
    assert torch.equal(pack_rows(q), qc.pack_gptq_rows(q))


@pytest.mark.parametrize("desc_act", [False, True])
def test_a_tensor_parallel_share_is_exactly_its_slice(desc_act) -> None:
    t = qc.gptq_tensors(_weight(5), 128, False, desc_act, seed=5)
    whole = w4a16.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 128, 1)
    full = whole.dequantized()
    assert torch.equal(whole.columns(32, 80).dequantized(), full[32:80])
    for a, b in ((0, 128), (128, 256), (64, 160)):  # whole groups, and shares that cut groups
        share = whole.rows(a, b)
        assert torch.equal(share.dequantized(), full[:, a:b]), (a, b)
        x = torch.randn(3, b - a)
        layer = w4a16.W4A16Linear(share, None)
        torch.testing.assert_close(layer(x), x @ full[:, a:b].t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        whole.rows(0, 80)


def test_fp8_weights_quantize_per_row_and_checkpoint_scales_expand() -> None:
    w = _weight(7)
    q = fp8_linear.quantize_fp8_weight(w)
    assert q.weight.dtype == FP8 and q.weight_scale.shape == (N,)
    rel = (q.dequantized() - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 2.0**-4 * 1.01  # half an e4m3 step at the row's largest binade
    t = qc.fp8_tensors(w, per_channel=False, input_absmax=3.0)
    ck = fp8_linear.from_checkpoint(t["weight"], t["weight_scale"], t["input_scale"])
    assert torch.equal(ck.weight_scale, t["weight_scale"].expand(N))
    fused = fp8_linear.fuse([ck, fp8_linear.from_checkpoint(t["weight"], t["weight_scale"] * 2,
                                                            t["input_scale"] * 2)], "qkv")
    assert fused.weight.shape == (2 * N, K) and fused.input_scale.item() == pytest.approx(6.0 / 448)


def test_fp8_twin_is_the_per_token_quantized_product() -> None:
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(5, K, generator=g), fp8_linear.quantize_fp8_weight(_weight(8))
    xq, xs = quantize_fp8_rows_ref(x)
    assert xq.float().abs().amax(dim=1).eq(448).all()  # each row's largest value lands on e4m3's maximum
    want = (xq.float() @ w.weight.float().t()) * xs[:, None] * w.weight_scale[None, :]
    assert torch.equal(fp8_gemm_ref(x, w.weight, w.weight_scale), want)
    # and it is the product within FP8's error
    rel = (want - x @ w.dequantized().t()).abs().max() / (x @ w.dequantized().t()).abs().max()
    assert rel < 0.05


# --------------------------------------------------------------------------------- Triton under the interpreter

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["g32", "g128", "g_idx", "split4"])
def test_w4a16_triton_matches_its_twin(dtype, case) -> None:
    g = torch.Generator().manual_seed(["g32", "g128", "g_idx", "split4"].index(case))
    group = 128 if case == "g128" else 32
    q = torch.randint(0, 16, (K, 40), generator=g)
    groups = K // group
    scales = (torch.rand(groups, 40, generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 16, (groups, 40), generator=g).to(torch.uint8)
    g_idx = (torch.arange(K) // group).to(torch.int32) if case == "g_idx" else None
    x = torch.randn(3, K, generator=g).to(dtype)
    tiles = (16, 32, 4) if case == "split4" else None
    got = w4a16_gemm_triton(x, pack_rows(q), scales, zeros, group, g_idx, tiles=tiles)
    want = w4a16_gemm_ref(x, pack_rows(q), scales, zeros, group, g_idx)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["g32", "g128", "g_idx"])
def test_w4a16_dequantization_kernel_gives_the_twins_bits(dtype, case) -> None:
    g = torch.Generator().manual_seed(11)
    group = 128 if case == "g128" else 32
    n = 200  # not a multiple of the column tile: masked
    q = torch.randint(0, 16, (K, n), generator=g)
    scales = (torch.rand(K // group, n, generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 16, (K // group, n), generator=g).to(torch.uint8)
    # act-order: rows' groups in a shuffled order (every group still K / group rows)
    g_idx = (torch.randperm(K, generator=g) // group).to(torch.int32) if case == "g_idx" else None
    got = w4a16_dequant_triton(pack_rows(q), scales, zeros, group, g_idx, dtype)
    want = w4a16_dequant_ref(pack_rows(q), scales, zeros, group, g_idx, dtype)
    assert got.dtype == dtype and got.shape == (K, n)
    assert torch.equal(got, want)
    rows = torch.arange(K) // group if g_idx is None else g_idx.long()
    assert torch.equal(want, ((q - zeros[rows].int()).float() * scales[rows].float()).to(dtype))  # the definition
    assert torch.equal(w4a16_dequant(pack_rows(q), scales, zeros, group, g_idx, dtype), want)  # the dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_triton_matches_its_twin(dtype, static) -> None:
    g = torch.Generator().manual_seed(9)
    k = 160  # not a multiple of the K tile: masked
    w = fp8_linear.quantize_fp8_weight(torch.randn(72, k, generator=g) * 0.05)
    x = (torch.randn(19, k, generator=g) * 3).to(dtype)
    x[0, :8] = torch.tensor([1.95, -1.95, 0.0, 448.0, 1e-4, 3.9, 7.8, 15.5])  # the rounding's carries
    x[1] = 0.0  # an all-zero row
    inp = torch.tensor([0.02]) if static else None
    got = fp8_gemm_triton(x, w.weight, w.weight_scale, inp)
    want = fp8_gemm_ref(x, w.weight, w.weight_scale, inp)
    assert got.dtype == dtype and not got[1].any()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantization_kernel_gives_the_twins_bits(dtype, static) -> None:
    g = torch.Generator().manual_seed(10)
    k = 1100  # over one 1,024-value chunk, not a multiple of it: the row is read in two masked chunks
    x = (torch.randn(6, k, generator=g) * 3).to(dtype)
    x[0, :8] = torch.tensor([1.95, -1.95, 0.0, 448.0, 1e-4, 3.9, 7.8, 15.5])  # the rounding's carries
    x[1] = 0.0  # an all-zero row
    x[2, 1090] = -700.0  # the row's max in the second chunk
    inp = torch.tensor([0.02]) if static else None
    q, scales = quantize_fp8_triton(x, inp)
    if static:
        want_q, want_s = quantize_fp8_static_ref(x, inp), inp.expand(6)
    else:
        want_q, want_s = quantize_fp8_rows_ref(x)
    assert q.dtype == FP8 and scales.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)
    # and the dispatch (the twin here) agrees with both
    dq, ds = quantize_fp8(x, inp)
    assert torch.equal(dq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(ds, want_s)


# --------------------------------------------------------------------------------------- quantization_config


@pytest.mark.parametrize("config, method", [
    (qc.awq_config(128), "awq"), (qc.gptq_config(32, sym=False, desc_act=True), "gptq"),
    (qc.fp8_config(static=True), "fp8"), (qc.compressed_tensors_fp8_config(), "fp8"),
    (qc.compressed_tensors_fp8_config(per_channel=False, static=True), "fp8")])
def test_servable_configs_are_read(tmp_path, config, method) -> None:
    q = parse_quantization_config({"quantization_config": config}, tmp_path / "config.json")
    assert q.method == method
    if config.get("activation_scheme") == "static" or "static" in q.fmt:
        assert q.fp8_static_input


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not servable"),
    (qc.awq_config(256), "group size 256"),
    (dict(qc.gptq_config(128), bits=8), "8-bit"),
    (dict(qc.awq_config(128), version="gemv"), "'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    (dict(qc.compressed_tensors_fp8_config(), format="pack-quantized"), "'pack-quantized'"),
    ({**qc.compressed_tensors_fp8_config(), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                             "strategy": "channel"}}}},
     "weight-only")])
def test_unservable_configs_are_refused_naming_what_is_supported(tmp_path, config, words) -> None:
    with pytest.raises(CheckpointError, match="supported: awq") as e:
        parse_quantization_config({"quantization_config": config}, tmp_path / "config.json")
    assert words in str(e.value) and "quantization_config." in str(e.value)


def test_the_flag_and_the_checkpoint_must_agree(tmp_path) -> None:
    awq = parse_quantization_config({"quantization_config": qc.awq_config(128)}, tmp_path)
    assert resolve_checkpoint_quantization("auto", awq, "m") == "awq"
    assert resolve_checkpoint_quantization("fp8", None, "m") == "fp8"
    assert resolve_checkpoint_quantization("auto", None, "m") is None
    with pytest.raises(ValueError, match="is a awq gemm checkpoint; serve it with --quantization awq"):
        resolve_checkpoint_quantization("gptq", awq, "m")
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_checkpoint_quantization("awq", None, "m")


def test_quantized_weights_are_sized_as_served() -> None:
    k, n = 4096, 14336
    assert linear_bytes(None, k, n, 0, 2) == 2 * k * n
    assert linear_bytes("fp8", k, n, 0, 2) == k * n + 4 * n
    assert linear_bytes("awq", k, n, 128, 2) == k * n // 2 + (k // 128) * n * 3
