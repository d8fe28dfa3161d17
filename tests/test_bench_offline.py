"""Smoke tests of the offline benchmarks: both commands run end to end on a tiny model and write
the JSON keys issue 2 names. Speed is not checked here; the full-size runs are by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workload import TINY_SHAPE, build_bench_model
from loadtest.cli import main

OFFLINE_KEYS = ("kvmesh_tok_s", "hf_batched_tok_s", "hf_unbatched_tok_s", "hf_continuous_tok_s",
                "ratio_vs_hf_batched", "ratio_vs_hf_continuous")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_bench_model(str(tmp_path_factory.mktemp("bench-model")), TINY_SHAPE, seed=0)


def test_bench_offline_writes_all_figures(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", tiny_model, "--json", str(out), "--num-prompts", "6",
               "--input-len-min", "8", "--input-len-max", "48", "--output-len-min", "4", "--output-len-max", "16",
               "--hf-batch-size", "4", "--hf-unbatched-requests", "2", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "128", "--kv-cache-bytes", str(16 << 20)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in OFFLINE_KEYS:
        assert report[key] is not None and report[key] > 0, key
    assert report["workload"]["num_prompts"] == 6
    assert report["machine"]["torch"]
    # Same weights, greedy, float32: the first request must match transformers token for token.
    assert report["correctness"]["kvmesh_first_request_equal"] is True


def test_bench_prefix_reports_cache_hits(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", tiny_model, "--json", str(out), "--prompt-len", "200",
               "--shared-len", "180", "--num-warm", "2", "--max-num-batched-tokens", "256",
               "--kv-cache-bytes", str(16 << 20)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("ttft_cold_s", "ttft_warm_s", "ratio"):
        assert report[key] > 0, key
    assert report["cold_cached_tokens"] == 0
    assert min(report["warm_cached_tokens"]) > 0
    assert min(report["warm_cached_tokens"]) == report["expected_cached_tokens"] == 176


def test_presets_fill_only_what_was_not_given() -> None:
    import argparse

    from loadtest.offline import add_arguments, resolve

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = resolve(p.parse_args(["--preset", "nano-vllm", "--num-prompts", "3"]))
    assert (args.num_prompts, args.input_len_min, args.input_len_max, args.output_len_min, args.output_len_max,
            args.shape) == (3, 100, 1024, 100, 1024, "qwen3-0.6b")
    assert args.hf_batch_size == 16 and args.kv_cache_bytes == 1 << 30  # CPU defaults
    cuda = resolve(p.parse_args(["--device", "cuda"]))
    assert cuda.hf_batch_size == 128 and cuda.kv_cache_bytes is None and cuda.shape == "bench"


def test_real_shapes_are_the_published_configs() -> None:
    from loadtest.shapes import SHAPES, hf_config

    qwen = hf_config(SHAPES["qwen3-0.6b"])
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim, qwen.intermediate_size, qwen.vocab_size, qwen.tie_word_embeddings) == (
        1024, 28, 16, 8, 128, 3072, 151936, True)
    llama8b = hf_config(SHAPES["llama-3.1-8b"])
    assert (llama8b.hidden_size, llama8b.intermediate_size, llama8b.tie_word_embeddings) == (4096, 14336, False)
    assert llama8b.rope_parameters["rope_type"] == "llama3" and llama8b.rope_parameters["factor"] == 8.0
    assert not SHAPES["llama-3.1-8b"].write_weights


def test_config_only_shape_and_a_failing_baseline_is_skipped_not_fatal(tmp_path: Path, monkeypatch) -> None:
    """A config-only checkpoint (kvmesh's dummy weights, transformers' own init) runs, the correctness
    check says why it cannot compare, and a baseline that raises is reported as skipped."""
    from loadtest import hf_baselines
    from loadtest.shapes import RealShape, build_shape_checkpoint

    tiny = RealShape("tiny", "LlamaForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, max_position_embeddings=256, dtype="bfloat16"), write_weights=False)
    model = build_shape_checkpoint(str(tmp_path / "m"), tiny)

    def broken(*a, **k):
        raise TypeError("ContinuousBatchingConfig.__init__() got an unexpected keyword argument 'page_size'")

    monkeypatch.setattr(hf_baselines, "run_continuous", broken)
    out = tmp_path / "o.json"
    rc = main(["bench", "offline", "--model", model, "--json", str(out), "--num-prompts", "3", "--input-len-min", "4",
               "--input-len-max", "12", "--output-len-min", "2", "--output-len-max", "5", "--hf-batch-size", "2",
               "--baselines", "batched,continuous", "--max-num-seqs", "4", "--kv-cache-bytes", str(4 << 20)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["kvmesh_tok_s"] > 0 and report["hf_batched_tok_s"] > 0
    assert "page_size" in report["skipped"]["hf_continuous"]
    assert report["correctness"]["reason"] == "different random weights"
    assert report["runs"]["kvmesh"]["num_kv_blocks"] > 0 and report["machine"]["triton"]


def test_bench_decode_reports_steps_and_attention_bandwidth(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", tiny_model, "--device", "cpu", "--json", str(out), "--batch-sizes",
               "1,3", "--context-len", "40", "--steps", "3", "--attn-batch", "2", "--attn-context", "64"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [s["batch"] for s in report["steps"]] == [1, 3]
    for s in report["steps"]:
        assert s["ms_per_step"] > 0 and s["gpu_busy_share"] is None  # n/a on CPU
    attn = report["decode_attention"]
    assert attn["kv_bytes"] == 2 * 2 * 64 * 2 * 16 * 4 and 0 < attn["fraction_of_copy"]
    assert report["cuda_graphs"] is False
