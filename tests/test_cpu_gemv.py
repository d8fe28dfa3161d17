"""The decode matmul kernels for CPUs without native bf16 (kernels/cpu/gemv_bf16.cpp, gemv_gguf.cpp) against their
torch twins, the int8-activation error bound, the decoder stack with the new linear kinds against the eager model,
the 16-bit-weights load path, and KVMESH_CPU_ISA's masking (an AVX2-only build of the kernels is the slow test)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import extension
from kernels.cpu import gemv_gguf as G
from kernels.cpu.extension import native_status
from kernels.cpu.gemv_bf16 import linear_w16, linear_w16_ref
from shared.models.cpu_native import NativeDecode
from shared.models.quant_linear import GgufLinear, WeightLinear
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import greedy, make_engine, random_prompts

# 1-16: the row-block kernels (4-row passes and their tails); above: float32 tiles, except int8 activations
# (GGUF's ACT_Q8), which stay on the block kernels up to MAX_ROWS_Q8, and 16-bit weights, which take blocks of
# weight rows from 9 rows (5 for in >= 1024) up to 64
ROWS = [1, 3, 4, 5, 16, 17, 32, 33, 40, 65]
# (out, in): in = 64 and 96 have fewer blocks than the kernels take at once (8), 576 eight twice and 2 more, 256
# exactly eight
SHAPES = [(24, 64), (100, 576), (7, 96), (40, 256)]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    ok, why = native_status()
    assert ok, f"the C++ CPU kernels did not load: {why}"


def _close(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Equal up to float32 summation order: within 1e-5 of the sum of |x| |w| (the largest any partial sum gets)."""
    scale = x.abs() @ w.abs().t()
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert ((out - ref).abs() <= 1e-5 * scale + 1e-6).all(), float(((out - ref).abs() / (scale + 1e-6)).max())


def _blocks(n: int, k: int, g: torch.Generator):
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02
    q4 = G.pack_q4(codes, d, -8 * d + torch.randn(n, k // 32, generator=g) * 0.01)
    q8 = G.pack_q8(torch.randint(-127, 128, (n, k), generator=g).to(torch.int8), d)
    d16 = torch.rand(n, k // 16, generator=g) * 0.02  # Q6_K's form: codes in [-32, 31], a scale per 16
    q8_16 = G.pack_q8_16(torch.randint(-32, 32, (n, k), generator=g).to(torch.int8), d16)
    return {G.Q4: q4, G.Q8_0: q8, G.Q8_16: q8_16}, codes, d


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w16_kernel_matches_twin(rows, dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g)
        _close(linear_w16(x, w, bias), linear_w16_ref(x, w, bias), x, w.float())
        _close(linear_w16(x, w), linear_w16_ref(x, w), x, w.float())


def test_the_matmul_ops_trace_under_torch_compile() -> None:
    """--cpu-compile traces a step through these ops: their fake shapes (kernels/cpu/extension.py) let a graph
    hold them, and the compiled graph returns the op's own result."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g).to(torch.bfloat16)
    qs, scales = _blocks(48, 64, g)[0][G.Q4]
    both = torch.compile(lambda x: (linear_w16(x, w) + 1, G.linear_gguf(x, qs, scales, None, G.Q4, G.ACT_Q8) * 2),
                         fullgraph=True)
    got_w16, got_gguf = both(x)
    assert torch.equal(got_w16, linear_w16(x, w) + 1)
    assert torch.equal(got_gguf, G.linear_gguf(x, qs, scales, None, G.Q4, G.ACT_Q8) * 2)


@pytest.mark.parametrize("rows", ROWS)
def test_gguf_kernels_match_twin(rows) -> None:
    g = torch.Generator().manual_seed(100 + rows)
    for n, k in SHAPES:
        if k % 32:
            continue
        blocks, codes, d = _blocks(n, k, g)
        x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
        for fmt, (qs, sc) in blocks.items():
            w = G.dequantize_ref(qs, sc, fmt)
            for act in (G.ACT_F32, G.ACT_Q8):
                _close(G.linear_gguf(x, qs, sc, bias, fmt, act), G.linear_gguf_ref(x, qs, sc, bias, fmt, act), x, w)
        # the layout: the twin's dequantization is the format's definition, w = q d + m per 32 columns
        qs, sc = blocks[G.Q4]
        ref = codes.float().view(n, -1, 32) * sc[..., :1] + sc[..., 1:]
        assert torch.equal(G.dequantize_ref(qs, sc, G.Q4), ref.view(n, k))


def test_q4_float16_scales_give_the_float32_scales_bits() -> None:
    """Scales exact in float16 (a GGUF's Q4_0 / Q4_1 ones) are kept so; every path (one row, row blocks, float32
    tiles; int8 and float32 activations) multiplies them as the same values in float32: the same bits. Scales
    that float16 would round stay float32."""
    g = torch.Generator().manual_seed(11)
    for n, k in ((33, 320), (64, 576), (8, 64)):
        codes = torch.randint(0, 16, (n, k), generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        qs, sc = G.pack_q4(codes, d, (-8 * d).half().float())
        assert sc.dtype == torch.float16
        for rows in (1, 2, 5, 17, 33, 40):
            x = torch.randn(rows, k, generator=g)
            for act in (G.ACT_F32, G.ACT_Q8):
                out = G.linear_gguf(x, qs, sc, None, G.Q4, act)
                assert torch.equal(out, G.linear_gguf(x, qs, sc.float(), None, G.Q4, act)), (n, k, rows, act)
                _close(out, G.linear_gguf_ref(x, qs, sc, None, G.Q4, act), x, G.dequantize_ref(qs, sc, G.Q4))
    assert G.pack_q4(codes, d + 1e-7, d)[1].dtype == torch.float32


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """The C++ stack and the eager model batch rows differently (and a row's own step varies with the batch), so
    each row's output must be the same bits whether it runs alone (a single row goes through the kernels that take
    two weight rows at a time, an odd last one alone) or in any 4-row pass or tail."""
    g = torch.Generator().manual_seed(7)
    for n, k in ((24, 64), (100, 576), (40, 256), (33, 320)):
        blocks, _, _ = _blocks(n, k, g)
        x = torch.randn(7, k, generator=g)
        for fmt, (qs, sc) in blocks.items():
            for act in (G.ACT_F32, G.ACT_Q8):
                together = G.linear_gguf(x, qs, sc, None, fmt, act)
                alone = torch.cat([G.linear_gguf(x[i:i + 1], qs, sc, None, fmt, act) for i in range(7)])
                assert torch.equal(alone, together), (n, k, fmt, act)
    # 16-bit weights; in = 200 and 1040 leave a tail past the vectors. 7 rows take one weight row at a time (the
    # wide blocks where in >= 1024), 21 the wide blocks (three weight rows by two activation rows; out = 100 and 21
    # rows leave a tail of each).
    for n, k in ((24, 64), (33, 200), (100, 576), (31, 1040)):
        for rows in (7, 21):
            x = torch.randn(rows, k, generator=g)
            for dtype in (torch.bfloat16, torch.float16):
                w = torch.randn(n, k, generator=g).to(dtype)
                alone = torch.cat([linear_w16(x[i:i + 1], w) for i in range(rows)])
                assert torch.equal(alone, linear_w16(x, w)), (n, k, rows, dtype)
                assert torch.equal(linear_w16(x[:9], w), linear_w16(x, w)[:9]), (n, k, rows, dtype)


def test_int8_activations_error_bound() -> None:
    """ACT_Q8 rounds each activation by at most half its block's step (max |x| / 254): the output is within
    sum |w| * step / 2 of the exact float32 product (plus float32 rounding)."""
    g = torch.Generator().manual_seed(5)
    blocks, _, _ = _blocks(64, 256, g)
    x = torch.randn(4, 256, generator=g) * torch.logspace(-2, 1, 256)  # blocks of very different ranges
    step = (x.view(4, -1, 32).abs().amax(-1, keepdim=True) / 127).expand(4, 8, 32).reshape(4, 256)
    for fmt, (qs, sc) in blocks.items():
        w = G.dequantize_ref(qs, sc, fmt)
        exact = x @ w.t()
        got = G.linear_gguf(x, qs, sc, None, fmt, G.ACT_Q8)
        bound = (step / 2) @ w.abs().t() + 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
        assert ((got - exact).abs() <= bound).all()
        assert not torch.allclose(got, exact, rtol=1e-6, atol=1e-6)  # it does round


def test_bad_shapes_rejected() -> None:
    g = torch.Generator().manual_seed(0)
    (qs, sc), _, _ = (lambda b: ((b[0][G.Q4]), b[1], b[2]))(_blocks(8, 64, g))
    with pytest.raises(AssertionError):
        G.linear_gguf(torch.randn(2, 64), qs, sc, None, G.Q8_0, G.ACT_F32)  # Q4 codes as Q8_0
    with pytest.raises(AssertionError):
        linear_w16(torch.randn(2, 64), torch.randn(8, 64), None)  # a float32 weight
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kvmesh_cpu.linear_gguf(torch.randn(2, 48), qs, sc, None, 0, 0)


def _quantize_q4(w: torch.Tensor):
    n, k = w.shape
    b = w.float().view(n, k // 32, 32)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15
    q = torch.round((b - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]).clamp(0, 15).view(n, k)
    return q, d, lo


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("gemv-llama"), seed=3)


def test_decoder_stack_with_new_kinds_matches_eager(llama) -> None:
    """q/k/v and down as Q4 blocks (int8 activations), o_proj Q8_0 (float32 activations), gate/up bf16: the C++
    stack's greedy tokens and logprobs equal the eager model's (the same layers called from Python) up to a
    near-tie, batched and alone."""
    engine = make_engine(llama, dtype="float32")
    for layer in engine.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        a.qkv_proj = GgufLinear.from_q4(*_quantize_q4(a.qkv_proj.weight), a.qkv_proj.bias, G.ACT_Q8, "Q4_1")
        a.o_proj = GgufLinear.from_q8_0(a.o_proj.weight, None, G.ACT_F32)[0]
        mlp.gate_up_proj = WeightLinear(mlp.gate_up_proj.weight, None, torch.bfloat16)
        mlp.down_proj = GgufLinear.from_q4(*_quantize_q4(mlp.down_proj.weight), None, G.ACT_Q8, "Q4_0")
    native = NativeDecode(engine.model)
    engine.runner.native = native
    prompts = random_prompts([5, 16, 40], seed=2)  # 40: a prompt chunk through the eager path (float32 tiles)
    on = engine.generate(prompts, greedy(10, logprobs=3))
    assert native.calls >= 5  # every decode step after the 40-token prefill
    engine.runner.native = None
    off = engine.generate(prompts, greedy(10, logprobs=3))
    for a, b in zip(on, off):
        _same_up_to_a_near_tie(a, b)
    for batch in ([prompts[0]], prompts[:2], [prompts[0], prompts[2]]):
        engine.runner.native = native
        on = engine.generate(batch, greedy(10, logprobs=3))
        engine.runner.native = None
        for a, b in zip(on, engine.generate(batch, greedy(10, logprobs=3))):
            _same_up_to_a_near_tie(a, b)


# Int8 activations turn an ulp of difference before a matmul (the stack's norms and attention against torch's)
# into a code step of 1/254 of a block's largest value: the two paths' logprobs differ by up to ~0.02 nats on this
# random model, whose top tokens are often closer than that.
NEAR_TIE = 0.05


def _same_up_to_a_near_tie(a, b) -> None:  # noqa: ANN001 - two RequestOutputs of the same prompt
    """Greedy tokens equal and logprobs within NEAR_TIE, up to a step where b's two candidates are that close."""
    for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        if x.token_id != y.token_id:
            theirs = dict(y.top)
            assert x.token_id in theirs and theirs[y.token_id] - theirs[x.token_id] <= NEAR_TIE, (step, x, y)
            return
        assert abs(x.logprob - y.logprob) <= NEAR_TIE, (step, x, y)
    assert a.output_token_ids == b.output_token_ids


def test_bf16_checkpoint_keeps_16bit_weights_without_native_bf16(llama, tmp_path, monkeypatch) -> None:
    """--dtype auto on a CPU without native bf16 (emulated by KVMESH_CPU_ISA=avx2): float32 compute, the bf16
    checkpoint's linears stay bf16 (WeightLinear), and the C++ stack takes them; pinned float32 keeps nn.Linear."""
    from shared.models.loader import load_model

    cfg = json.loads((llama.path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    for p in llama.path.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes()) if p.is_file() else None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    pinned, _ = load_model(tmp_path, dtype="auto")
    assert type(pinned.layers[0].mlp.down_proj).__name__ == "Linear"
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx2")
    monkeypatch.delenv("KVMESH_CPU_DTYPE", raising=False)
    model, _ = load_model(tmp_path, dtype="auto")
    assert model.norm.weight.dtype == torch.float32
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, WeightLinear) and layer.weight16.dtype == torch.bfloat16
    assert isinstance(model.lm_head, WeightLinear)
    assert torch.equal(layer.dequantized(), pinned.layers[0].mlp.down_proj.weight.bfloat16().float())
    assert NativeDecode(model).stack.num_layers == len(model.layers)


def test_isa_override_masks_flags(monkeypatch) -> None:
    from shared.models.cpu_dtype import native_bf16_flag

    info = "flags\t: fpu sse avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_bf16\n"
    assert "-mavx512f" in extension.cpu_flags(info) and native_bf16_flag(info) == "amx_bf16"
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx2")
    assert extension.cpu_flags(info) == ["-mavx2", "-mfma", "-mf16c"] and native_bf16_flag(info) is None
    monkeypatch.setenv("KVMESH_CPU_ISA", "generic")
    assert extension.cpu_flags(info) == []
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="KVMESH_CPU_ISA"):
        extension.cpu_flags(info)


_AVX2_CHECK = """
import torch
from kernels.cpu.extension import native_status
ok, why = native_status()
assert ok and "avx512" not in why, why
from kernels.cpu import gemv_gguf as G
from kernels.cpu.gemv_bf16 import linear_w16, linear_w16_ref
g = torch.Generator().manual_seed(0)
for rows in (1, 5, 17):
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(40, 576, generator=g)
    scale = x.abs() @ w.abs().t()
    assert ((linear_w16(x, w.bfloat16()) - linear_w16_ref(x, w.bfloat16())).abs() <= 1e-5 * scale + 1e-6).all()
    blocks = {G.Q4: G.pack_q4(torch.randint(0, 16, (40, 576), generator=g), torch.rand(40, 18, generator=g),
                              torch.randn(40, 18, generator=g)),
              G.Q8_0: G.pack_q8(torch.randint(-127, 128, (40, 576), generator=g).to(torch.int8),
                                torch.rand(40, 18, generator=g)),
              G.Q8_16: G.pack_q8_16(torch.randint(-32, 32, (40, 576), generator=g).to(torch.int8),
                                    torch.rand(40, 36, generator=g))}
    for fmt, (qs, sc) in blocks.items():
        for act in (0, 1):
            out, ref = G.linear_gguf(x, qs, sc, None, fmt, act), G.linear_gguf_ref(x, qs, sc, None, fmt, act)
            wd = G.dequantize_ref(qs, sc, fmt)
            assert ((out - ref).abs() <= 1e-5 * (x.abs() @ wd.abs().t()) + 1e-5).all(), (fmt, act)
print("avx2 ok", why)
"""


@pytest.mark.slow
def test_avx2_build_matches_twins() -> None:
    """The kernels built as for an AVX2-only CPU (KVMESH_CPU_ISA=avx2: its own build, about a minute on 2 idle
    cores) against the twins, in a fresh process."""
    env = dict(os.environ, KVMESH_CPU_ISA="avx2", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and "avx2 ok" in r.stdout, r.stderr[-3000:]


def _interleaved_case(fmt: int, n: int, k: int, half: bool, g: torch.Generator):
    """(plain fmt, plain blocks, interleaved blocks) of random weights: Q4 with float16 or float32 scales, or Q8_0
    with codes of both signs, zero and the extremes."""
    lanes = G.q4x_lanes()
    d = torch.rand(n, k // 32, generator=g) * 0.02
    if fmt == G.Q4X:
        m = -8 * d + torch.randn(n, k // 32, generator=g) * 0.01
        codes = torch.randint(0, 16, (n, k), generator=g)
        plain = G.pack_q4(codes, d.half().float() if half else d, m.half().float() if half else m)
        assert (plain[1].dtype == torch.float16) == half
        return G.Q4, plain, G.pack_q4x(*plain, lanes), G.unpack_q4x
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    q[0, :8] = torch.tensor([-127, 127, 0, -1, 1, 0, -127, 127], dtype=torch.int8)
    plain = G.pack_q8(q, d)
    return G.Q8_0, plain, G.pack_q8x(*plain, lanes), G.unpack_q8x


@pytest.mark.parametrize("fmt,half", [(G.Q4X, True), (G.Q4X, False), (G.Q8X, False)])
def test_interleaved_rows_match_the_plain_layout_and_the_twin(fmt, half) -> None:
    """Q4X / Q8X (rows interleaved in groups of the build's lanes, one vector lane a row): the same weights as the
    plain blocks (unpacked back bit for bit), every step size within float32 summation of the twin, past 32 rows
    the dequantized tiles, and a row's bits the same alone as in any batch."""
    lanes = G.q4x_lanes()
    assert lanes in (8, 16)
    g = torch.Generator().manual_seed(21 + fmt)
    for n, k in ((lanes, 64), (3 * lanes, 576), (2 * lanes, 1056)):
        base, (qs, sc), (qx, sx), unpack = _interleaved_case(fmt, n, k, half, g)
        assert all(torch.equal(a, b) for a, b in zip(unpack(qx, sx, lanes), (qs, sc)))
        w = G.dequantize_ref(qs, sc, base)
        assert torch.equal(G.dequantize_ref(qx, sx, fmt), w)
        bias = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 4, 5, 9, 32, 33):
            x = torch.randn(rows, k, generator=g)
            out = G.linear_gguf(x, qx, sx, bias, fmt, G.ACT_Q8)
            _close(out, G.linear_gguf_ref(x, qs, sc, bias, base, G.ACT_Q8), x, w)
            if rows <= G.MAX_ROWS_Q8:
                for r in (0, rows - 1):
                    assert torch.equal(G.linear_gguf(x[r:r + 1], qx, sx, bias, fmt, G.ACT_Q8), out[r:r + 1])
    with pytest.raises(AssertionError, match="int8 activations"):
        G.linear_gguf(x, qx, sx, None, fmt, G.ACT_F32)
    with pytest.raises(RuntimeError, match="groups of"):
        torch.ops.kvmesh_cpu.linear_gguf(torch.randn(1, 64), qs[:lanes - 1, :qs.shape[1] * 64 // k].contiguous(),
                                         sc[:lanes - 1, :2].contiguous(), None, fmt, G.ACT_Q8)


@pytest.mark.parametrize("fmt", [G.Q4X, G.Q8X, G.Q4, G.Q8_0])
def test_bf16_activations_give_the_float32_paths_bits_rounded_once(fmt) -> None:
    """A bf16 model's activations go in as they are (the interleaved kernels read and write bf16; the others
    convert): the same bits as the float32 call on the same values, rounded to bf16 once, with or without a bias."""
    lanes = G.q4x_lanes()
    g = torch.Generator().manual_seed(31)
    interleaved = fmt in (G.Q4X, G.Q8X)
    _, plain, packed, _ = _interleaved_case(G.Q4X if fmt in (G.Q4X, G.Q4) else G.Q8X, 2 * lanes, 576, True, g)
    qs, sc = packed if interleaved else plain
    bias = torch.randn(2 * lanes, generator=g)
    for rows in (1, 3, 4, 7, 33):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        for b in (None, bias):
            got = G.linear_gguf(x, qs, sc, b, fmt, G.ACT_Q8)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, G.linear_gguf(x.float(), qs, sc, b, fmt, G.ACT_Q8).bfloat16()), (rows, b is None)


def test_gguf_linear_interleaves_q4_rows_where_it_can() -> None:
    lanes = G.q4x_lanes()
    g = torch.Generator().manual_seed(5)
    for n, act, want in ((2 * lanes, G.ACT_Q8, G.Q4X), (2 * lanes + 1, G.ACT_Q8, G.Q4), (2 * lanes, G.ACT_F32, G.Q4)):
        codes = torch.randint(0, 16, (n, 64), generator=g)
        d = torch.rand(n, 2, generator=g) * 0.02
        layer = GgufLinear.from_q4(codes, d, -8 * d, None, act, "Q4_0")
        assert layer.fmt == want and layer.in_features == 64
        ref = (codes.float().view(n, 2, 32) * d[..., None] - 8 * d[..., None]).view(n, 64)
        assert torch.equal(layer.dequantized(), ref)
    for n, act, want in ((2 * lanes, G.ACT_Q8, G.Q8X), (lanes + 1, G.ACT_Q8, G.Q8_0), (lanes, G.ACT_F32, G.Q8_0)):
        w = torch.randint(-127, 128, (n, 64), generator=g).float() * 0.01
        layer, _ = GgufLinear.from_q8_0(w, None, act)
        assert layer.fmt == want
        assert torch.equal(layer.dequantized(), GgufLinear.from_q8_0(w, None, G.ACT_F32)[0].dequantized())
