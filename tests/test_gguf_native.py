"""A GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 weights served on CPU without a bf16 copy (shared/models/gguf_quant.py): the
blocks kept by the conversion are exactly what gguf dequantizes, the int4 layers built from them multiply by the
file's codes with bf16-rounded scales (bounded error), layers are chosen by type, and `--quantization auto` picks
it only where it applies. Tiny files are written by gguf's GGUFWriter and read back by its GGUFReader."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.engine.kv_cache import engine_root
from shared.engine.llm_engine import LLMEngine
from shared.models.dp_linear import ENV as DP_ENV
from shared.models.dp_linear import DpLinear, dp_linear_choice
from shared.models.gguf_blocks import BLOCKS_FILE, dequantize_q4
from shared.models.gguf_quant import HYBRID_MAX_ROWS, OWN_HYBRID_MAX_ROWS, RowSplitLinear
from shared.models.loader import load_model
from shared.models.model_source import resolve_model
from shared.models.quant_linear import GgufLinear, Int4Linear, Int8Linear
from shared.sampling_params import SamplingParams
from tests.gguf_files import TinySpec, write_tiny_gguf

# q/k/v mix Q4_0, Q4_1 and Q4_K (one int4 layer: a Q4_K super-block is eight Q4_1-like blocks), o is Q8_0 (int8),
# gate/up mix Q4_1 and Q5_0 (kept), down is Q4_0.
TYPES = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q4_K", "attn_output.weight": "Q8_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q4_0"}
BF16_ULP = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-9 of it; 2^-8 is slack


@pytest.fixture(autouse=True)
def _torch_int4(monkeypatch) -> None:
    """These tests are of torch's int4/int8 path (bf16 on AMX CPUs, or with oneDNN's matmul chosen); the GGUF
    kernels' bf16 path has its own test below."""
    monkeypatch.setenv(DP_ENV, "onednn")


@pytest.fixture(scope="module")
def tiny(smollm2_gguf_file, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("gguf-native")
    path = write_tiny_gguf(tmp / "tiny.Q4_1.gguf", smollm2_gguf_file, TinySpec(arch="llama", types=TYPES))
    return resolve_model(path, tmp / "cache")


def test_kept_blocks_dequantize_exactly_as_gguf(tiny) -> None:
    """Codes, d and m read back from the converted directory give gguf's float32 dequantization bit for bit (the
    converted model.safetensors holds that, un-permuted; tests/test_gguf.py checks it against gguf itself)."""
    with safe_open(str(Path(tiny) / BLOCKS_FILE), framework="np") as f, \
            safe_open(str(Path(tiny) / "model.safetensors"), framework="np") as ref:
        names = {k.rsplit(".", 1)[0] for k in f.keys()}
        kept = {f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj")}
        assert kept <= names
        assert "model.layers.0.mlp.up_proj.weight" not in names  # Q5_0: not kept
        for n in sorted(names):
            got = dequantize_q4(f.get_tensor(f"{n}.codes"), f.get_tensor(f"{n}.d"), f.get_tensor(f"{n}.m"))
            np.testing.assert_array_equal(got, ref.get_tensor(n))


def test_real_reader_blocks_match_gguf_dequantize(tiny, smollm2_gguf_file) -> None:
    """The block parser on the real SmolLM2 file's first Q4_1 tensor, against gguf's own dequantizer."""
    from shared.models.gguf_blocks import q4_blocks

    reader = gguf.GGUFReader(str(smollm2_gguf_file))
    t = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    got = dequantize_q4(*q4_blocks(np.asarray(t.data), "Q4_1"))
    np.testing.assert_array_equal(got, gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.shape))


def test_layers_by_type_and_int4_error_bound(tiny) -> None:
    native, _ = load_model(tiny, dtype="bfloat16", quantization="gguf", pack_weights=False)
    exact, _ = load_model(tiny, dtype="float32")
    types = []
    with safe_open(str(Path(tiny) / BLOCKS_FILE), framework="pt") as f:
        for i, (nl, el) in enumerate(zip(native.layers, exact.layers)):
            types.append(tuple(type(m).__name__ for m in (nl.self_attn.qkv_proj, nl.self_attn.o_proj,
                                                          nl.mlp.gate_up_proj, nl.mlp.down_proj)))
            for layer, ref, parts in ((nl.self_attn.qkv_proj, el.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                                      (nl.mlp.down_proj, el.mlp.down_proj, ("down_proj",))):
                prefix = "self_attn" if parts[0] != "down_proj" else "mlp"
                d = torch.cat([f.get_tensor(f"model.layers.{i}.{prefix}.{p}.weight.d") for p in parts])
                m = torch.cat([f.get_tensor(f"model.layers.{i}.{prefix}.{p}.weight.m") for p in parts])
                # (q - 8) bf16(d) + bf16(m + 8 d): each weight moves by at most 8 |d| + |m + 8 d| bf16 ulps, and
                # dequantized() (the kernel on the identity) returns it rounded to bf16: |w| more.
                w = ref.weight.view(*d.shape, 32)
                bound = (8 * d.abs() + (m + 8 * d).abs())[..., None] * BF16_ULP + w.abs() * BF16_ULP + 1e-7
                err = (layer.dequantized().view(w.shape) - w).abs()
                assert (err <= bound).all(), f"layer {i} {parts}: {(err / bound).max()}"
                x = torch.randn(3, ref.in_features).bfloat16()
                y_exact = x.float() @ ref.weight.t()
                y_bf16 = (x @ ref.weight.bfloat16().t()).float()
                # the native output is as close to the exact one as bf16-rounded weights give, within 2x
                assert (layer(x).float() - y_exact).abs().max() <= 2 * (y_bf16 - y_exact).abs().max() + 1e-3
    assert types == [("Int4Linear", "Int8Linear", "Linear", "Int4Linear")] * 2
    assert isinstance(native.lm_head, nn.Linear)  # F16 embeddings: the tied head stays bf16
    assert native.lm_head.weight.dtype == torch.bfloat16


def test_hybrid_uses_int4_for_small_steps_and_bf16_above(tiny) -> None:
    hybrid, _ = load_model(tiny, dtype="bfloat16", quantization="gguf-hybrid", pack_weights=True)
    plain, _ = load_model(tiny, dtype="bfloat16", quantization="gguf", pack_weights=True)
    dense, _ = load_model(tiny, dtype="bfloat16", quantization=None, pack_weights=True)
    layer = hybrid.layers[0].mlp.down_proj
    assert isinstance(layer, RowSplitLinear) and isinstance(layer.quantized, Int4Linear)
    for rows, ref in ((HYBRID_MAX_ROWS, plain), (HYBRID_MAX_ROWS + 1, dense)):
        x = torch.randn(rows, layer.quantized.in_features).bfloat16()
        assert torch.equal(layer(x), ref.layers[0].mlp.down_proj(x))


def test_bf16_hybrid_on_the_kernels_own_threads(tiny, monkeypatch) -> None:
    """With the own AVX512-BF16 matmul (shared/models/dp_linear.py) a bf16 model's GGUF layers go to the GGUF
    block kernels (bf16 activations widened to float32) up to OWN_HYBRID_MAX_ROWS rows, a DpLinear twin above;
    Q8_0 blocks are rebuilt from the bf16 weights; every matmul is the kernels', so their loops leave torch's team."""
    monkeypatch.setenv(DP_ENV, "own")
    if not dp_linear_choice()[0]:
        pytest.skip("the C++ kernels are off or built without AVX512-BF16")
    from kernels.cpu.thread_pool import stats
    from shared.models.cpu_native import choose_kernel_threads

    hybrid, _ = load_model(tiny, dtype="bfloat16", quantization="gguf-hybrid", pack_weights=True)
    blocks, _ = load_model(tiny, dtype="bfloat16", quantization="gguf", pack_weights=True)
    exact, _ = load_model(tiny, dtype="float32")
    for name in ("qkv_proj", "o_proj"):
        layer, ref = getattr(hybrid.layers[0].self_attn, name), getattr(exact.layers[0].self_attn, name)
        assert isinstance(layer, RowSplitLinear) and isinstance(layer.quantized, GgufLinear)
        assert isinstance(layer.dense, DpLinear)
        assert isinstance(getattr(blocks.layers[0].self_attn, name), GgufLinear)
        for rows in (1, OWN_HYBRID_MAX_ROWS, OWN_HYBRID_MAX_ROWS + 1, 40):
            x = torch.randn(rows, ref.in_features).bfloat16()
            out = layer(x)
            assert out.dtype == torch.bfloat16
            want = (layer.quantized if rows <= OWN_HYBRID_MAX_ROWS else layer.dense)(x)
            assert torch.equal(out, want)
            y_exact = x.float() @ ref.weight.t()
            y_bf16 = (x @ ref.weight.bfloat16().t()).float()
            # the int8 activations and bf16 output rounding: within a few times bf16 weights' own error
            assert (out.float() - y_exact).abs().max() <= 4 * (y_bf16 - y_exact).abs().max() + 2e-3, (name, rows)
    assert isinstance(hybrid.layers[0].mlp.gate_up_proj, DpLinear)  # Q5_0 kept: the plain bf16 layer
    assert choose_kernel_threads(hybrid).endswith("on their own threads: the matmuls are these kernels too")
    assert stats()[4] == 0


def test_auto_picks_native_only_where_it_applies(tiny, tmp_path, monkeypatch) -> None:
    cfg = lambda **kw: EngineConfig(model=tiny, device="cpu", num_kv_blocks=16, **kw)  # noqa: E731
    assert cfg(dtype="bfloat16", quantization="auto").quantization == "gguf-hybrid"
    assert cfg(dtype="bfloat16", quantization="none").quantization is None
    assert cfg(dtype="bfloat16").quantization is None  # the engine API's default: as configured, no auto
    assert cfg(dtype="float32", quantization="auto").quantization is None  # the native kernels compute in bf16
    monkeypatch.setenv("KVMESH_CPU_DTYPE", "bfloat16")
    assert cfg(dtype="auto", quantization="auto").quantization == "gguf-hybrid"
    # float32 by request: the C++ block kernels serve it when asked for, auto leaves the float32 weights alone
    assert cfg(dtype="float32", quantization="gguf").quantization == "gguf"
    with pytest.raises(ConfigError, match="float16"):
        cfg(dtype="float16", quantization="gguf")
    # float32 because the CPU has no native bf16 (emulated on any CPU by KVMESH_CPU_ISA=avx2): auto serves blocks
    monkeypatch.delenv("KVMESH_CPU_DTYPE")
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx2")
    assert cfg(dtype="auto", quantization="auto").quantization == "gguf"
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "torch")
    assert cfg(dtype="auto", quantization="auto").quantization is None
    with pytest.raises(ConfigError, match="C\\+\\+ CPU kernels"):
        cfg(dtype="auto", quantization="gguf")
    with pytest.raises(ConfigError, match="not a converted GGUF"):
        EngineConfig(model=str(tmp_path), device="cpu", dtype="bfloat16", quantization="gguf")
    # native and dequantized weights compute different KV: their blocks never share a hash
    assert engine_root(cfg(dtype="bfloat16", quantization="gguf"), torch.bfloat16) != \
        engine_root(cfg(dtype="bfloat16", quantization="none"), torch.bfloat16)


def test_engine_serves_native_close_to_dequantized(tiny) -> None:
    prompt = [1, 504, 3101, 27, 915, 4412, 28, 8, 77]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = {}
    for quant in ("gguf", "none"):
        e = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="bfloat16", quantization=quant, num_kv_blocks=64,
                                   max_num_batched_tokens=256, max_num_seqs=4))
        assert any(isinstance(m, Int4Linear) for m in e.model.modules()) == (quant == "gguf")
        outs[quant] = e.generate([prompt], params, use_tqdm=False)[0]
    first = outs["gguf"].logprobs[0]
    ref = outs["none"].logprobs[0]
    assert outs["gguf"].output_token_ids[0] == outs["none"].output_token_ids[0]
    assert abs(first.logprob - ref.logprob) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("matmul", ["onednn", "own"])
def test_smollm2_native_q4_1_quality_against_dequantized(smollm2_dir, matmul, monkeypatch) -> None:
    """The real demo model, native Q4_1 (torch's int4 layers and int8 head with oneDNN's matmul; the GGUF block
    kernels with int8 activations and the AVX512-BF16 kernel with the kernels' own) vs its dequantized bf16 weights
    (served by the same matmul): perplexity of a
    fixed text within 1%, and greedy chat answers that stay together for most of their first 16 tokens (bf16
    rounding alone splits near-ties: measured, 18 of 32 rows identical over 32 tokens)."""
    import math

    from loadtest.chat_prompts import KINDS, PERPLEXITY_TEXT, TOPICS
    from shared.models.tokenizer import encode_chat, load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    text_ids = tok(PERPLEXITY_TEXT.read_text())["input_ids"]
    chats = [encode_chat(tok, [{"role": "user", "content": k.format(t)}]) for t in TOPICS for k in KINDS][:8]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv(DP_ENV, matmul)
    if matmul == "own" and not dp_linear_choice()[0]:
        pytest.skip("the C++ kernels are off or built without AVX512-BF16")
    head = Int8Linear if matmul == "onednn" else GgufLinear
    ppl, toks = {}, {}
    for quant in ("gguf", "none"):
        e = LLMEngine(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="bfloat16", quantization=quant,
                                   num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=1024))
        assert isinstance(e.model.lm_head, head) == (quant == "gguf")
        out = e.generate([text_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        lps = [p.logprob for p in out.prompt_logprobs if p is not None]
        ppl[quant] = math.exp(-sum(lps) / len(lps))
        toks[quant] = [o.output_token_ids for o in e.generate(chats, params, use_tqdm=False)]
    assert abs(ppl["gguf"] / ppl["none"] - 1) < 0.01, ppl
    def _first_difference(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    together = sum(_first_difference(a, b) for a, b in zip(toks["gguf"], toks["none"])) / len(chats)
    assert together >= 8, f"{together} tokens before the first difference, mean of 8 rows"


def _float32_engines(model_dir: str, monkeypatch) -> tuple[LLMEngine, LLMEngine]:  # noqa: ANN001
    """The engine on a CPU without native bf16 (KVMESH_CPU_ISA=avx2, --dtype and --quantization auto: the blocks
    as stored), then the same with the weights pinned to float32 (dequantized, no GgufLinear)."""
    from shared.models.quant_linear import GgufLinear

    monkeypatch.delenv("KVMESH_CPU_DTYPE", raising=False)
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx2")
    config = dict(model=model_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=256, max_num_seqs=4,
                  quantization="auto")
    assert EngineConfig(**config).quantization == "gguf"
    blocks = LLMEngine(EngineConfig(**config))
    assert blocks.model.norm.weight.dtype == torch.float32 and blocks.runner.native is not None
    monkeypatch.setenv("KVMESH_CPU_DTYPE", "float32")
    dequant = LLMEngine(EngineConfig(**config))
    assert not any(isinstance(m, GgufLinear) for m in dequant.model.modules())
    return blocks, dequant


def _kinds(layer: nn.Module) -> list[tuple[str, str | None]]:
    return [(type(m).__name__, getattr(m, "gguf_type", None)) for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _assert_greedy_follows(blocks: LLMEngine, dequant: LLMEngine) -> None:
    """Same first token, first logprob within 0.05 (int8 activations move each logprob a little)."""
    prompt = [1, 504, 3101, 27, 915, 4412, 28, 8, 77]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    a, b = (e.generate([prompt], params, use_tqdm=False)[0] for e in (blocks, dequant))
    assert a.output_token_ids[0] == b.output_token_ids[0]
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05


def test_float32_serving_keeps_blocks_without_native_bf16(tiny, monkeypatch) -> None:
    """The real loader on a CPU without native bf16 (KVMESH_CPU_ISA=avx2, --dtype and --quantization auto): float32
    compute, Q4 and Q8_0 layers as GgufLinear holding the file's codes (their dequantization is the converted
    float32 weights bit for bit), the Q5_0 layer dequantized; the engine's greedy tokens and logprobs follow the
    dequantized float32 model's (int8 activations move each logprob a little)."""
    blocks, dequant = _float32_engines(tiny, monkeypatch)
    exact, _ = load_model(tiny, dtype="float32")
    layer = blocks.model.layers[0]
    assert _kinds(layer) == [("GgufLinear", "Q4_0+Q4_1+Q4_K"), ("GgufLinear", "Q8_0"), ("Linear", None),
                             ("GgufLinear", "Q4_0")]
    for name in ("qkv_proj", "o_proj"):
        got = getattr(layer.self_attn, name).dequantized()
        assert torch.equal(got, getattr(exact.layers[0].self_attn, name).weight)
    assert torch.equal(layer.mlp.down_proj.dequantized(), exact.layers[0].mlp.down_proj.weight)
    _assert_greedy_follows(blocks, dequant)


def test_q4_k_m_style_file_serves_q4_k_and_q6_k_blocks(smollm2_gguf_file, tmp_path, monkeypatch) -> None:
    """A Q4_K_M-style file (Q4_K layers, Q6_K down projections and value rows): the kept blocks dequantize exactly
    as gguf does (Q6_K as int8 codes with a float32 scale per 16); in float32 serving without native bf16 the
    Q4_K and Q6_K layers are C++ block layers whose weights are the file's bit for bit, q/k/v (Q4_K beside Q6_K)
    stay dequantized, and greedy tokens follow the dequantized float32 model's."""
    spec = TinySpec(arch="llama", types={"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K"}, default_type="Q4_K")
    tiny = resolve_model(write_tiny_gguf(tmp_path / "tiny.Q4_K_M.gguf", smollm2_gguf_file, spec), tmp_path / "cache")
    with safe_open(str(Path(tiny) / BLOCKS_FILE), framework="np") as f, \
            safe_open(str(Path(tiny) / "model.safetensors"), framework="np") as ref:
        for i in (0, 1):
            down = f"model.layers.{i}.mlp.down_proj.weight"
            codes, d = f.get_tensor(f"{down}.codes"), f.get_tensor(f"{down}.d")
            assert codes.dtype == np.int8 and codes.min() >= -32 and codes.max() <= 31
            got = (codes.reshape(codes.shape[0], -1, 16).astype(np.float32) * d[..., None]).reshape(codes.shape)
            np.testing.assert_array_equal(got, ref.get_tensor(down))
            gate = f"model.layers.{i}.mlp.gate_proj.weight"
            got = dequantize_q4(f.get_tensor(f"{gate}.codes"), f.get_tensor(f"{gate}.d"), f.get_tensor(f"{gate}.m"))
            np.testing.assert_array_equal(got, ref.get_tensor(gate))

    blocks, dequant = _float32_engines(tiny, monkeypatch)
    layer, exact = blocks.model.layers[0], load_model(tiny, dtype="float32")[0].layers[0]
    assert _kinds(layer) == [("Linear", None), ("GgufLinear", "Q4_K"), ("GgufLinear", "Q4_K"), ("GgufLinear", "Q6_K")]
    assert torch.equal(layer.mlp.down_proj.dequantized(), exact.mlp.down_proj.weight)
    assert torch.equal(layer.mlp.gate_up_proj.dequantized(), exact.mlp.gate_up_proj.weight)
    _assert_greedy_follows(blocks, dequant)


@pytest.mark.slow  # compiling two buckets keeps both cores busy for ~30 s; the ops' tracing is a fast test
def test_compiled_decode_runs_through_the_block_kernels(tiny) -> None:
    """--cpu-compile on with the GGUF served as stored in float32 (GgufLinear, the CPU without native bf16): the
    step traces through the C++ block kernels (their fake shapes, kernels/cpu/extension.py) and answers as eager
    does. Float32 fused loops round differently from eager's ops, so the first token and its logprob are compared
    within a tolerance, and decode steps must come through the compiled forward."""
    prompts = [[1, 504, 3101, 27, 915, 4412, 28, 8, 77], [1, 77, 28, 915]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = {}
    for mode in ("off", "on"):
        e = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", quantization="gguf", num_kv_blocks=64,
                                   max_num_batched_tokens=256, max_num_seqs=2, cpu_compile=mode))
        assert any(isinstance(m, GgufLinear) for m in e.model.modules())
        outs[mode] = e.generate(prompts, params, use_tqdm=False)
        if mode == "on":
            assert [b for b, _ in e.executor.cpu_compile_seconds] == [1, 2]
            assert e.runner.graphs.forward.calls > 5
    for eager, compiled in zip(outs["off"], outs["on"]):
        assert compiled.output_token_ids[0] == eager.output_token_ids[0]
        assert abs(compiled.logprobs[0].logprob - eager.logprobs[0].logprob) < 1e-3
