"""Quantized checkpoints of tiny llama / qwen3 / mistral models, written here in the published AWQ, GPTQ and FP8
formats (tests/quant_checkpoints.py), loaded through the real loader and served by the engine on CPU (the kernels'
torch twins):

- prompt logprobs equal transformers' running the weights *as each format defines them* (dequantized by the
  format's definition, and for FP8 the activations quantized per token or by the static scale) within 2e-3: a
  layer mapped to the wrong tensors, a wrong nibble order or a wrong zero moves them by far more;
- and stay within a stated distance of the unquantized model (4-bit: 1.0 nats at most on these tiny random models,
  whose logits are near-flat; FP8: 0.3);
- a bad checkpoint is refused naming the tensor; an unservable one, or a flag that disagrees with it, at start
  (FP8 below sm_89 with a faked capability);
- tensor parallelism: a TP=2 GPTQ act-order engine gives TP=1's logprobs, each rank holding its share."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from kernels.fp8_quant_rows import quantize_fp8_rows_ref, quantize_fp8_static_ref
from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.models.errors import CheckpointError
from shared.models.fp8_linear import Fp8Linear
from shared.models.w4a16 import W4A16Linear
from shared.sampling_params import SamplingParams
from tests import quant_checkpoints as qc
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import make_engine, random_prompts

PROMPTS = random_prompts([9, 33], seed=3)
# K a multiple of 128 everywhere (hidden 128, q 128, intermediate 256), so group 128 applies to every layer.
WIDE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("quant")
    return {"llama": build_checkpoint("llama", root / "llama", intermediate_size=256),
            "qwen3": build_checkpoint("qwen3", root / "qwen3", **WIDE),
            "mistral": build_checkpoint("mistral", root / "mistral")}


def _engine(path: Path, **overrides):  # noqa: ANN202
    return make_engine(SimpleNamespace(path=path), dtype="float32", device="cpu", **overrides)


def _logprobs(engine) -> torch.Tensor:  # noqa: ANN001
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    return torch.tensor([p.logprob for out in engine.generate(PROMPTS, params, use_tqdm=False)
                         for p in out.prompt_logprobs[1:]])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _reference(ckpt, path: Path, method: str, group: int = 0, v1: bool = True, static: bool = False):  # noqa: ANN001, ANN202
    """transformers' model with each projection's weights as the format defines them; FP8 activations quantized
    before each projection as the format says (per token, or by the static input_scale)."""
    hf = copy.deepcopy(ckpt.hf_model)
    t = _tensors(path)
    with torch.no_grad():
        for name, mod in hf.named_modules():
            dense = f"{name}.weight" in t and t[f"{name}.weight"].dtype != torch.float8_e4m3fn
            if not name.endswith(qc.PROJS) or dense:
                continue
            if method == "awq":
                w = qc.dequant_awq(t[f"{name}.qweight"], t[f"{name}.qzeros"], t[f"{name}.scales"], group)
            elif method == "gptq":
                w = qc.dequant_gptq(t[f"{name}.qweight"], t[f"{name}.qzeros"], t[f"{name}.scales"], t[f"{name}.g_idx"], v1)
            else:
                w = t[f"{name}.weight"].float() * t[f"{name}.weight_scale"].float().reshape(-1, 1)
                if static:
                    # the fused q/k/v (gate/up) share the largest of their parts' static scales
                    parent = name.rsplit(".", 1)[0]
                    sib = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
                    kind = sib.get(name.rsplit(".", 1)[1])
                    names = [f"{parent}.{p}" for p in (("q_proj", "k_proj", "v_proj") if kind == "qkv" else
                                                       ("gate_proj", "up_proj") if kind == "gu" else
                                                       (name.rsplit(".", 1)[1],))]
                    s = torch.stack([t[f"{n}.input_scale"].float().reshape(()) for n in names]).amax()
                    mod.register_forward_pre_hook(
                        lambda m, a, s=s: (quantize_fp8_static_ref(a[0][0], s).float()[None] * s,))
                else:
                    mod.register_forward_pre_hook(
                        lambda m, a: (lambda q: (q[0].float() * q[1][:, None])[None])(quantize_fp8_rows_ref(a[0][0])))
            mod.weight.copy_(w)
    return hf


def _hf_logprobs(hf) -> torch.Tensor:  # noqa: ANN001
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            lp = hf(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)
            out.append(lp.gather(1, torch.tensor(p[1:])[:, None])[:, 0])
    return torch.cat(out)


CASES = {
    # name: (arch, method, quantization_config, writer options, reference options, bound vs unquantized)
    "llama-awq-g32": ("llama", "awq", qc.awq_config(32), dict(group=32), dict(group=32), 1.0),
    "qwen3-awq-g128": ("qwen3", "awq", qc.awq_config(128), dict(group=128), dict(group=128), 1.0),
    "qwen3-gptq-g128-actorder-asym": ("qwen3", "gptq", qc.gptq_config(128, sym=False, desc_act=True),
                                      dict(group=128, sym=False, desc_act=True), {}, 1.0),
    "mistral-gptq-g32-sym-v2": ("mistral", "gptq", qc.gptq_config(32, sym=True, v1=False),
                                dict(group=32, sym=True, v1=False), dict(v1=False), 1.0),
    "mistral-fp8-channel-dynamic": ("mistral", "fp8", qc.compressed_tensors_fp8_config(), dict(per_channel=True), {},
                                    0.3),
    "llama-fp8-tensor-static": ("llama", "fp8", qc.fp8_config(static=True), dict(static=True), dict(static=True), 0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_serves_what_its_format_defines(ckpts, tmp_path, case) -> None:
    arch, method, config, opts, ref_opts, bound = CASES[case]
    ckpt = ckpts[arch]
    # Dynamic FP8 scales by each token's max: an ulp of difference in the activations (summation order) can move a
    # value across an e4m3 rounding boundary, a step of 1/16 of it; elsewhere only the summation order differs.
    tol = 2e-2 if method == "fp8" and not ref_opts.get("static") else 2e-3
    opts = dict(opts)
    if opts.pop("static", False):
        opts["absmax"] = qc.input_absmax(ckpt.hf_model, PROMPTS)
    path = qc.write_quantized(ckpt.path, tmp_path / case, method, config, **opts)
    engine = _engine(path)  # --quantization auto: from the checkpoint's quantization_config
    assert engine.config.quantization == method
    layer = engine.model.layers[1]
    assert isinstance(layer.mlp.down_proj, Fp8Linear if method == "fp8" else W4A16Linear)
    ours = _logprobs(engine)
    theirs = _hf_logprobs(_reference(ckpt, path, method, **ref_opts))
    unquantized = _hf_logprobs(ckpt.hf_model)
    near, far = (ours - theirs).abs().max().item(), (ours - unquantized).abs().max().item()
    print(f"{case}: vs the format's definition {near:.1e}, vs unquantized {far:.2f} (bound {bound})")
    assert near < tol and far < bound and far > 10 * near, (near, far)


def test_fp8_at_load_quantizes_an_unquantized_checkpoint(ckpts) -> None:
    ckpt = ckpts["llama"]
    engine = _engine(ckpt.path, quantization="fp8")
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    far = (_logprobs(engine) - _hf_logprobs(ckpt.hf_model)).abs().max().item()
    assert 0 < far < 0.3
    tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert all(len(o.output_token_ids) == 6 for o in tokens)


def test_a_layer_the_checkpoint_left_unquantized_loads_as_it_is(ckpts, tmp_path) -> None:
    ckpt = ckpts["llama"]
    skip = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")
    path = qc.write_quantized(ckpt.path, tmp_path / "ignored", "awq", qc.awq_config(32), group=32, skip=skip)
    engine = _engine(path)
    assert type(engine.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert isinstance(engine.model.layers[0].mlp.down_proj, W4A16Linear)
    theirs = _hf_logprobs(_reference(ckpt, path, "awq", group=32))
    assert (_logprobs(engine) - theirs).abs().max() < 2e-3


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001
    """Apply edit(tensors) to the checkpoint's tensors in place (one shard file)."""
    from safetensors.torch import save_file

    tensors = _tensors(path)
    edit(tensors)
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def test_bad_quantized_checkpoints_are_refused_naming_the_tensor(ckpts, tmp_path) -> None:
    ckpt = ckpts["llama"]
    base = qc.write_quantized(ckpt.path, tmp_path / "awq", "awq", qc.awq_config(32), group=32)

    def broken(name: str, edit) -> Path:  # noqa: ANN001
        import shutil

        out = tmp_path / name
        shutil.copytree(base, out)
        _rewrite(out, edit)
        return out

    cases = [
        (lambda t: t.pop("model.layers.0.mlp.down_proj.qzeros"), "model.layers.0.mlp.down_proj.qzeros: missing"),
        (lambda t: t.__setitem__("model.layers.1.self_attn.o_proj.scales", torch.ones(3, 64, dtype=torch.float16)),
         "shape [3, 64], expected [2, 64]"),
        (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.qweight",
                                 t["model.layers.0.mlp.up_proj.qweight"].float()),
         "dtype F32; a awq gemm checkpoint has I32"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64)),
         "q_proj: quant, self_attn.k_proj: dense"),
    ]
    for i, (edit, words) in enumerate(cases):
        with pytest.raises(CheckpointError) as e:
            _engine(broken(f"bad{i}", edit))
        assert words in str(e.value), str(e.value)


def test_gptq_parts_of_a_fused_layer_must_share_their_act_order(ckpts, tmp_path) -> None:
    ckpt = ckpts["llama"]
    path = qc.write_quantized(ckpt.path, tmp_path / "gptq", "gptq", qc.gptq_config(32, desc_act=True), group=32,
                              desc_act=True)

    def swap(t: dict) -> None:  # v_proj's rows in another act order than q/k's
        q = qc.gptq_tensors(ckpt.hf_model.model.layers[0].self_attn.v_proj.weight, 32, True, True, seed=99)
        t.update({f"model.layers.0.self_attn.v_proj.{k}": v for k, v in q.items()})

    _rewrite(path, swap)
    with pytest.raises(CheckpointError, match="qkv_proj have different g_idx"):
        _engine(path)


def _with_config(src: Path, out: Path, quantization_config: dict) -> Path:
    import shutil

    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_start_refuses_unservable_checkpoints_and_flags_that_disagree(ckpts, tmp_path) -> None:
    plain = str(ckpts["llama"].path)
    bnb = _with_config(ckpts["llama"].path, tmp_path / "bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ConfigError, match="'bitsandbytes' is not servable; supported: awq"):
        EngineConfig(model=str(bnb), device="cpu")
    awq = str(_with_config(ckpts["llama"].path, tmp_path / "awq", qc.awq_config(128)))
    with pytest.raises(ConfigError, match="is a awq gemm checkpoint; serve it with --quantization awq"):
        EngineConfig(model=awq, device="cpu", quantization="gptq")
    with pytest.raises(ConfigError, match="--quantization awq"):
        EngineConfig(model=awq, device="cpu", quantization="none")
    assert EngineConfig(model=awq, device="cpu", quantization="auto").quantization == "awq"
    with pytest.raises(ConfigError, match="has no quantization_config"):
        EngineConfig(model=plain, device="cpu", quantization="awq")


def test_fp8_is_refused_below_sm89(ckpts, tmp_path) -> None:
    plain = str(ckpts["llama"].path)
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9 .* sm_80"):
        EngineConfig(model=plain, device="cuda", gpu_capability=(8, 0), quantization="fp8")
    fp8 = str(_with_config(ckpts["llama"].path, tmp_path / "fp8", qc.fp8_config(static=False)))
    with pytest.raises(ConfigError, match="sm_86"):
        EngineConfig(model=fp8, device="cuda", gpu_capability=(8, 6))  # the checkpoint's own FP8, auto
    assert EngineConfig(model=plain, device="cuda", gpu_capability=(8, 9), quantization="fp8").quantization == "fp8"
    assert EngineConfig(model=fp8, device="cuda", gpu_capability=(9, 0)).quantization == "fp8"


def test_the_worker_flag_takes_the_gpu_quantizations() -> None:
    import argparse

    from services.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    for method in ("fp8", "awq", "gptq"):
        assert p.parse_args(["--model", "m", "--quantization", method]).quantization == method
    args = p.parse_args(["--model", "m", "--device", "cpu", "--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"


def test_the_gpu_plan_counts_quantized_weights_at_their_size(ckpts, tmp_path) -> None:
    from shared.launcher.gpu_plan import worker_needs
    from shared.models.model_config import load_model_config

    awq = _with_config(ckpts["qwen3"].path, tmp_path / "awq", qc.awq_config(128))
    plain, quant = load_model_config(ckpts["qwen3"].path), load_model_config(awq)
    bf16 = worker_needs(plain, "bfloat16", "auto", 256, 8).weights
    fp8 = worker_needs(plain, "bfloat16", "auto", 256, 8, quantization="fp8").weights
    w4 = worker_needs(quant, "bfloat16", "auto", 256, 8).weights
    h, inter, q, kv, layers = 128, 256, 128, 64, 2  # qwen3 WIDE: q = 4 heads x 32, kv = 2 x 32
    linear = h * (q + 2 * kv) + q * h + 3 * h * inter
    outputs = (q + 2 * kv) + h + 2 * inter + h  # one float32 scale per output row under FP8
    assert bf16 - fp8 == layers * (2 * linear - (linear + 4 * outputs))
    # 4-bit: half a byte a weight, and a float16 scale + uint8 zero per group of 128 rows and column (down: 2 groups)
    assert bf16 - w4 == layers * (2 * linear - (linear // 2 + 3 * (outputs + h)))


@pytest.mark.slow  # ~50 s a case on 2 busy cores: two follower processes
@pytest.mark.parametrize("method", ["gptq", "fp8"])
def test_tp2_quantized_checkpoint_equals_tp1(ckpts, tmp_path, method) -> None:
    """Row-parallel o/down: each rank keeps its rows (GPTQ act order: sorted by group, cutting groups where its
    share does, with the whole scales; FP8: its input columns, the row scales whole); column-parallel q/k/v and
    gate/up their output rows with their scales."""
    ckpt = ckpts["llama"]
    if method == "gptq":
        path = qc.write_quantized(ckpt.path, tmp_path / "q", "gptq", qc.gptq_config(32, sym=False, desc_act=True),
                                  group=32, sym=False, desc_act=True)
    else:
        path = qc.write_quantized(ckpt.path, tmp_path / "q", "fp8", qc.fp8_config(static=True),
                                  absmax=qc.input_absmax(ckpt.hf_model, PROMPTS))
    tp1 = _engine(path)
    tp2 = _engine(path, tensor_parallel_size=2)
    try:
        down = tp2.model.layers[0].mlp.down_proj
        assert isinstance(down.local, W4A16Linear if method == "gptq" else Fp8Linear)
        whole = tp1.model.layers[0].mlp.down_proj.dequantized()
        assert torch.equal(down.dequantized(), whole[:, : whole.shape[1] // 2])
        qkv, whole_qkv = tp2.model.layers[0].self_attn.qkv_proj.dequantized(), tp1.model.layers[0].self_attn.qkv_proj
        assert torch.equal(qkv[:32], whole_qkv.dequantized()[:32])  # rank 0's two query heads of 16
        ours = _logprobs(tp2)
    finally:
        tp2.shutdown()
    assert (ours - _logprobs(tp1)).abs().max() < 1e-3
