"""The GPU plan `kvmesh up` makes before it starts a worker (shared/launcher/gpu_plan.py), with fake GPU sizes:
the default layout that used to start a worker doomed to exit 78, the layouts picked instead, refusals, and
`kvmesh up --dry-run` end to end through the CLI."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.shapes import SHAPES, build_shape_checkpoint
from shared.engine.errors import EXIT_CONFIG, MemoryBudgetError
from shared.engine.memory_budget import GIB, MemoryProfile, plan_kv_pool
from shared.launcher.gpu_plan import (WORKER_DEFAULTS, PlanError, parameter_count, parse_gpu_memory, plan_mesh,
                                      worker_needs)
from shared.launcher.process_spec import MeshOptions, placement
from shared.models.model_config import load_model_config

GB = 10**9


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-shapes")
    out = {}
    for name in ("llama-3.1-8b", "qwen3-0.6b", "mistral-7b"):
        shape = replace(SHAPES[name], write_weights=False)  # config.json is all the plan reads
        out[name] = Path(build_shape_checkpoint(str(root / name), shape))
    return out


def needs_of(model_dir: Path, kv: str = "auto"):
    d = WORKER_DEFAULTS
    return worker_needs(load_model_config(model_dir), "auto", kv, d.max_num_batched_tokens, d.max_num_seqs)


def test_the_plan_uses_the_workers_own_defaults() -> None:
    from shared.config import EngineConfig

    cfg = EngineConfig(model="unused")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size) == (
        WORKER_DEFAULTS.max_num_batched_tokens, WORKER_DEFAULTS.max_num_seqs, WORKER_DEFAULTS.block_size)


def test_parameter_counts_match_the_published_sizes(shapes) -> None:
    # Llama-3.1-8B has 8.03 B parameters, Qwen3-0.6B 0.60 B (tied), Mistral-7B 7.24 B.
    assert parameter_count(load_model_config(shapes["llama-3.1-8b"])) == pytest.approx(8.03e9, rel=0.005)
    assert parameter_count(load_model_config(shapes["qwen3-0.6b"])) == pytest.approx(0.596e9, rel=0.01)
    assert parameter_count(load_model_config(shapes["mistral-7b"])) == pytest.approx(7.24e9, rel=0.005)
    assert needs_of(shapes["llama-3.1-8b"]).kv_per_token == 128 * 1024  # 128 KiB of bf16 KV a token


def test_the_old_default_layout_gives_llama_8b_a_prefill_worker_that_cannot_start(shapes) -> None:
    """Confirms the finding: 1 prefill + 1 decode on one 80 GB H100, prefill's third of 0.9 cannot hold the
    weights plus one 131,072-token request, so the worker's own budget check (plan_kv_pool) refuses it."""
    needs = needs_of(shapes["llama-3.1-8b"])
    total = 80 * GB
    share = placement(MeshOptions(devices=("0",)))
    assert share["prefill-0"].gpu_memory_utilization == 0.3
    profile = MemoryProfile(total, total, needs.weights, needs.activations, needs.overhead - (256 << 20), 256 << 20)
    with pytest.raises(MemoryBudgetError, match="one full-length request"):
        plan_kv_pool(profile, share["prefill-0"].gpu_memory_utilization, needs.kv_per_token * 16, 131072 // 16)
    plan_kv_pool(profile, share["decode-0"].gpu_memory_utilization, needs.kv_per_token * 16, 131072 // 16)


def test_llama_8b_on_one_80gb_gpu_runs_one_worker_with_the_full_context(shapes) -> None:
    plan = plan_mesh(MeshOptions(devices=("0",)), {"0": 80 * GB}, needs_of(shapes["llama-3.1-8b"]), 131072)
    assert (plan.prefill, plan.decode, plan.max_model_len) == (0, 1, 131072) and plan.fits
    assert "prefill locally" in plan.changes[0] and "prefill-0 has" in plan.changes[0]


def test_llama_8b_on_one_24gb_gpu_gets_a_shorter_context_that_fits(shapes) -> None:
    needs = needs_of(shapes["llama-3.1-8b"])
    plan = plan_mesh(MeshOptions(devices=("0",)), {"0": 24 * GB}, needs, 131072)
    assert (plan.prefill, plan.decode) == (0, 1) and plan.fits
    assert 1024 <= plan.max_model_len < 131072 and plan.max_model_len % 256 == 0
    # The longest that fits with 3% of the budget to spare: 256 tokens more would not.
    assert needs.total(plan.max_model_len + 256) > plan.workers[0].budget * 0.97
    assert f"max_model_len {plan.max_model_len} instead of 131072" in plan.changes[0]


def test_llama_8b_on_two_80gb_gpus_runs_as_asked(shapes) -> None:
    plan = plan_mesh(MeshOptions(devices=("0", "1")), {"0": 80 * GB, "1": 80 * GB}, needs_of(shapes["llama-3.1-8b"]),
                     131072)
    assert (plan.prefill, plan.decode, plan.max_model_len, plan.changes) == (1, 1, 131072, ())
    assert {w.name: w.device for w in plan.workers} == {"decode-0": "0", "prefill-0": "1"}


def test_qwen3_0_6b_on_one_80gb_gpu_runs_as_asked(shapes) -> None:
    plan = plan_mesh(MeshOptions(devices=("0",)), {"0": 80 * GB}, needs_of(shapes["qwen3-0.6b"]), 40960)
    assert (plan.prefill, plan.decode, plan.max_model_len, plan.changes) == (1, 1, 40960, ())


def test_mistral_7b_with_fp8_kv_fits_beside_its_prefill_worker(shapes) -> None:
    bf16, fp8 = needs_of(shapes["mistral-7b"]), needs_of(shapes["mistral-7b"], "fp8")
    assert fp8.kv_per_token * 2 == bf16.kv_per_token
    plan = plan_mesh(MeshOptions(devices=("0",), kv_cache_dtype="fp8"), {"0": 80 * GB}, fp8, 32768)
    assert (plan.prefill, plan.decode, plan.max_model_len, plan.changes) == (1, 1, 32768, ())


def test_an_explicit_layout_is_kept_or_refused_never_rearranged(shapes) -> None:
    needs = needs_of(shapes["mistral-7b"])
    # Two copies of 14.5 GB of weights in 0.9 x 24 GB: nothing keeps --prefill 1 --decode 1 on one GPU.
    with pytest.raises(PlanError, match="does not fit.*prefill-0 has"):
        plan_mesh(MeshOptions(devices=("0",)), {"0": 24 * GB}, needs, 32768, layout_given=True)
    # On 64 GB the asked layout stays, with a shorter context: the prefill share holds about 22k tokens.
    plan = plan_mesh(MeshOptions(devices=("0",)), {"0": 64 * GB}, needs, 32768, layout_given=True)
    assert (plan.prefill, plan.decode) == (1, 1) and plan.fits and plan.max_model_len < 32768


def test_a_model_that_does_not_fit_at_all_is_refused_with_what_it_needs(shapes) -> None:
    with pytest.raises(PlanError, match="the model does not fit: decode-0 has .* needs"):
        plan_mesh(MeshOptions(devices=("0",)), {"0": 16 * GB}, needs_of(shapes["llama-3.1-8b"]), 131072)
    with pytest.raises(PlanError, match="no memory size for GPU"):
        plan_mesh(MeshOptions(devices=("0", "1")), {"0": 80 * GB}, needs_of(shapes["qwen3-0.6b"]), 40960)


def test_gpu_memory_sizes() -> None:
    assert parse_gpu_memory(["80GiB"], ("0", "1")) == {"0": 80 * GIB, "1": 80 * GIB}
    assert parse_gpu_memory(["80GB", "1=24GB"], ("0", "1")) == {"0": 80 * GB, "1": 24 * GB}
    assert parse_gpu_memory(["81559MiB"], ("0",)) == {"0": 81559 << 20}
    assert parse_gpu_memory(["40"], ("0",)) == {"0": 40 * GIB}
    for bad in ("80TB", "lots", "0=", ""):
        with pytest.raises(PlanError, match="--gpu-memory"):
            parse_gpu_memory([bad], ("0",))


def _up(capsys, *argv: str) -> tuple[int, str, str]:
    from shared.cli import main

    rc = main(["up", "--dry-run", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dry_run_prints_the_plan_and_the_processes(shapes, capsys) -> None:
    model = str(shapes["llama-3.1-8b"])
    rc, out, _ = _up(capsys, "--model", model, "--devices", "0", "--gpu-memory", "80GiB")
    assert rc == 0
    assert "GPU plan: 1 decode + 0 prefill" in out and "changed:" in out
    assert "decode-0: -m services.decode" in out and "CUDA_VISIBLE_DEVICES=0" in out
    assert "prefill-0:" not in out and "--max-model-len" not in out
    rc, out, _ = _up(capsys, "--model", model, "--devices", "0", "--gpu-memory", "0=24GB")
    line = next(x for x in out.splitlines() if x.startswith("decode-0:"))
    assert rc == 0 and "--max-model-len" in line
    rc, out, _ = _up(capsys, "--model", model, "--devices", "0,1", "--gpu-memory", "80GiB")
    assert rc == 0 and "prefill-0:" in out and "changed:" not in out


def test_dry_run_refuses_what_cannot_fit_before_starting_anything(shapes, capsys) -> None:
    rc, _, err = _up(capsys, "--model", str(shapes["mistral-7b"]), "--devices", "0", "--gpu-memory", "24GB",
                     "--prefill", "1", "--decode", "1")
    assert rc == EXIT_CONFIG and "does not fit" in err
    rc, _, err = _up(capsys, "--model", str(shapes["qwen3-0.6b"]), "--devices", "0", "--gpu-memory", "big")
    assert rc == EXIT_CONFIG and "--gpu-memory" in err
    rc, out, _ = _up(capsys, "--model", str(shapes["qwen3-0.6b"]), "--devices", "none")
    assert rc == 0 and "no GPU plan" in out
