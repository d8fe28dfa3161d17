"""The llama.cpp baseline's build follows the CPU it runs on (loadtest/serve/llamacpp.py): made-up /proc/cpuinfo flag
sets, the --isa mask, the per-ISA cache layout; and the 4-bit GGUF the larger-shape comparison writes
(loadtest/experiments/llamacpp/shape_gguf.py) read back with gguf."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadtest.serve import llamacpp
from loadtest.serve.llamacpp import IsaBuild, binary_isa, cpu_flags

AVX2_CPU = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}


def _on(flags: list[str]) -> set[str]:
    return {f.removeprefix("-D").split("=")[0] for f in flags if f.endswith("=ON")}


def test_an_avx2_cpu_never_gets_avx512() -> None:
    isa = IsaBuild.for_cpu(AVX2_CPU)
    assert isa.name == "avx2"
    on = _on(isa.cmake_flags())
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_OPENMP"} <= on
    assert not {s for s in on if "AVX512" in s or "AMX" in s}
    assert "-DGGML_NATIVE=OFF" in isa.cmake_flags()


def test_avx512_follows_the_flags_and_masks_down() -> None:
    isa = IsaBuild.for_cpu(AVX512_CPU)
    assert isa.name == "avx512-vnni"
    assert "GGML_AVX512_BF16" not in _on(isa.cmake_flags())  # the CPU lacks avx512_bf16
    assert IsaBuild.for_cpu(AVX512_CPU | {"avx512_bf16"}).name == "avx512-vnni-bf16"
    masked = IsaBuild.for_cpu(AVX512_CPU, "avx2")
    assert masked == IsaBuild.for_cpu(AVX2_CPU) and masked.name == "avx2"
    assert IsaBuild.for_cpu(AVX512_CPU, "generic").features == ()
    # VNNI alone (no AVX512 foundation) turns nothing on.
    assert IsaBuild.for_cpu(AVX2_CPU | {"avx512_vnni"}).name == "avx2"
    with pytest.raises(ValueError):
        IsaBuild.for_cpu(AVX2_CPU, "sse9")


def test_cpuinfo_flags_are_read() -> None:
    text = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == {"fpu", "sse4_2", "avx", "avx2"}
    assert cpu_flags("") == set()


def test_cache_holds_one_build_per_isa(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVMESH_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("KVMESH_LLAMACPP_DIR", raising=False)
    monkeypatch.setattr(llamacpp, "CACHE_ROOT", tmp_path)
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda cpuinfo=None: AVX512_CPU)
    assert llamacpp.server_binary() is None

    def fake_build(tag: str) -> Path:
        binary = tmp_path / f"llamacpp-{tag}" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
        binary.mkdir(parents=True)
        (binary / "llama-server").write_text("")
        return binary / "llama-server"

    avx2 = fake_build("avx2")  # the layout `kvmesh bench llamacpp --build --isa avx2` writes
    assert llamacpp.cache_dir(IsaBuild.for_cpu(AVX2_CPU)) == tmp_path / "llamacpp-avx2"
    assert llamacpp.server_binary() == avx2  # the best build this CPU runs: only the AVX2 one so far
    full = fake_build("avx512-vnni")
    assert llamacpp.server_binary() == full
    assert llamacpp.server_binary("avx2") == avx2
    assert (binary_isa(full), binary_isa(avx2)) == ("avx512-vnni", "avx2")
    monkeypatch.setenv("KVMESH_LLAMACPP_DIR", str(tmp_path / "llamacpp-avx2"))
    assert llamacpp.server_binary() == avx2


def test_quantized_gguf_keeps_the_weights(tmp_path: Path) -> None:
    import gguf

    from loadtest.experiments.llamacpp.shape_gguf import quantize_gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    emb = rng.standard_normal((16, 64)).astype(np.float32)
    src = tmp_path / "m-f32.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("blk.0.attn_q.weight", w)
    writer.add_tensor("token_embd.weight", emb)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = quantize_gguf(src, tmp_path / "m-q4_0.gguf", "Q4_0")
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types == {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_0,
                     "token_embd.weight": gguf.GGMLQuantizationType.Q8_0,
                     "blk.0.attn_norm.weight": gguf.GGMLQuantizationType.F32}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    back = gguf.quants.dequantize(q.data, q.tensor_type)
    assert back.shape == w.shape
    assert np.abs(back - w).max() < 0.2 * np.abs(w).max()  # 4-bit: within a step of each block's scale
