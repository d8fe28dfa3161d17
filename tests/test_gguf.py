"""GGUF as a model source: every supported tensor type and architecture converts to a checkpoint whose
greedy output and logprobs equal transformers' own GGUF loading of the same file; the cache is keyed
by content and reused; bad files fail with one error naming the file and the field, leaving nothing behind."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.models import model_source
from shared.models.errors import CheckpointError
from shared.models.loader import load_model
from shared.models.model_config import load_model_config
from shared.models.model_source import model_name_of, resolve_model
from shared.sampling_params import SamplingParams
from tests.checkpoints import hf_greedy
from tests.gguf_files import TinySpec, write_tiny_gguf

ALL_QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q5_0", "attn_output.weight": "Q5_1",
             "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q6_K"}
CASES = {
    # every quantized type in one llama file (q/k permuted by llama.cpp's convention)
    "llama-quant": TinySpec(arch="llama", types=ALL_QUANT),
    "qwen2-float": TinySpec(arch="qwen2", types={"attn_q.weight": "F16", "attn_k.weight": "BF16", "attn_v.weight": "F32",
                                                  "ffn_down.weight": "BF16"}, default_type="Q8_0"),
    # head_dim 128 as in real Qwen3 files (transformers' GGUF config for qwen3 ignores key_length)
    "qwen3-mixed": TinySpec(arch="qwen3", heads=2, kv_heads=1, types={"attn_q.weight": "Q6_K", "attn_k.weight": "Q8_0"}, default_type="Q4_K"),
}
PROMPT = [1, 504, 3101, 27, 915, 4412, 28, 8, 77]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvmesh-cache")


def _engine_greedy(model_dir: str, prompt: list[int], n: int):
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, max_num_batched_tokens=256, max_num_seqs=4))
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True),
                           use_tqdm=False)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_matches_transformers_gguf_loading(case, smollm2_gguf_file, tmp_path, cache) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{case}.Q4_K_M.gguf", smollm2_gguf_file, CASES[case])
    model_dir = resolve_model(path, cache)
    assert Path(model_dir).name == f"tiny-{case}"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ref_tokens, ref_logprobs = hf_greedy(hf, PROMPT, 8)
    out = _engine_greedy(model_dir, PROMPT, 8)
    assert out.output_token_ids == ref_tokens
    for step, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - ref_logprobs[step][lp.token_id].item()) <= 1e-4


def test_every_tensor_type_dequantizes_as_gguf_does(smollm2_gguf_file, tmp_path, cache) -> None:
    """The weights in the converted checkpoint are gguf's dequantization, transposed to HF layout."""
    path = write_tiny_gguf(tmp_path / "t.gguf", smollm2_gguf_file, TinySpec(arch="qwen3", types=ALL_QUANT))
    model, cfg = load_model(resolve_model(path, cache))
    reader = gguf.GGUFReader(str(path))
    seen = set()
    params = dict(model.named_parameters())
    for t in reader.tensors:
        if t.name == "blk.1.ffn_down.weight":
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            assert torch.equal(params["layers.1.mlp.down_proj.weight"], torch.from_numpy(ref))
        seen.add(t.tensor_type.name)
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "F32"} <= seen
    assert cfg.qk_norm


def test_mistral_architecture_converts(smollm2_gguf_file, tmp_path, cache) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", smollm2_gguf_file, TinySpec(arch="mistral", default_type="Q5_1"))
    cfg = load_model_config(Path(resolve_model(path, cache)))
    assert cfg.architecture == "MistralForCausalLM" and cfg.num_kv_heads == 2


def test_cache_is_keyed_by_content_and_reused(smollm2_gguf_file, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    path = write_tiny_gguf(tmp_path / "a.gguf", smollm2_gguf_file, TinySpec(default_type="Q8_0"))
    first = resolve_model(path, cache)
    assert Path(first).parent.name.endswith(f"-v{model_source.LOADER_VERSION}")
    # A second start must not convert again: make conversion impossible and resolve once more,
    # also through the directory that holds the file.
    import shared.models.gguf_convert as conv

    monkeypatch.setattr(conv, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(path, cache) == first
    assert resolve_model(tmp_path, cache) == first
    # Same content under another name: same entry. Different content: another entry.
    other = write_tiny_gguf(tmp_path / "b" / "a.gguf", smollm2_gguf_file, TinySpec(default_type="Q8_0"), seed=1) \
        if (tmp_path / "b").mkdir() is None else None
    monkeypatch.undo()
    assert Path(resolve_model(other, cache)).parent != Path(first).parent
    assert sorted(p.name for p in cache.joinpath("gguf").iterdir() if not p.name.endswith(".lock")) == \
        sorted({Path(first).parent.name, Path(resolve_model(other, cache)).parent.name})


def test_concurrent_starts_convert_once_and_agree(smollm2_gguf_file, tmp_path) -> None:
    path = write_tiny_gguf(tmp_path / "c.gguf", smollm2_gguf_file, TinySpec(default_type="Q4_0"))
    cache = tmp_path / "cache"
    code = "import sys; from pathlib import Path; from shared.models.model_source import resolve_model; " \
           "print(resolve_model(sys.argv[1], Path(sys.argv[2])))"
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(cache)], stdout=subprocess.PIPE, text=True,
                              cwd=root) for _ in range(3)]
    outs = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    entries = [p for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1, entries  # no leftover temporary directories


def _assert_nothing_cached(cache: Path) -> None:
    left = [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] if (cache / "gguf").exists() else []
    assert left == []


def test_unsupported_architecture_is_one_clear_error(smollm2_gguf_file, tmp_path) -> None:
    path = write_tiny_gguf(tmp_path / "g.gguf", smollm2_gguf_file, TinySpec(arch="llama"))
    data = path.read_bytes().replace(b"llama", b"gpt99", 1)  # the architecture value comes first
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        resolve_model(path, tmp_path / "cache")
    assert str(path) in str(e.value) and "general.architecture" in str(e.value) and "gpt99" in str(e.value)
    _assert_nothing_cached(tmp_path / "cache")


def test_unsupported_tensor_type_is_one_clear_error(smollm2_gguf_file, tmp_path) -> None:
    path = tmp_path / "q2k.gguf"
    write_tiny_gguf(path, smollm2_gguf_file, TinySpec(default_type="Q8_0"))
    # Rewrite one tensor as Q2_K (raw blocks): a type kvmesh does not take.
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.name == "blk.1.attn_v.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
            w.add_tensor(t.name, np.zeros((shape[0], shape[1] // block * size), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        elif t.tensor_type.name in ("F32", "F16"):
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(CheckpointError) as e:
        resolve_model(tmp_path / "bad.gguf", tmp_path / "cache")
    assert "bad.gguf" in str(e.value) and "blk.1.attn_v.weight" in str(e.value) and "Q2_K" in str(e.value)
    _assert_nothing_cached(tmp_path / "cache")


def test_not_a_gguf_and_ambiguous_directories(tmp_path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match="x.gguf: header"):
        resolve_model(tmp_path / "x.gguf", tmp_path / "cache")
    (tmp_path / "y.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        resolve_model(tmp_path, tmp_path / "cache")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf", tmp_path / "cache")
    plain = tmp_path / "hf"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve_model(plain, tmp_path / "cache") == str(plain)  # an HF directory is itself


def test_served_name_drops_the_quantization() -> None:
    assert model_name_of(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_name_of(Path("qwen2.5-0.5b-instruct-q4_k_m.gguf")) == "qwen2.5-0.5b-instruct"
    assert model_name_of(Path("Model-F16.gguf")) == "Model"
