"""Issue 22: `kvmesh up` with tensor parallelism and --devices. Each worker's ranks get their own GPUs
(CUDA_VISIBLE_DEVICES lists them in rank order, so rank r runs on cuda:r), the GPU plan budgets and needs per rank,
combinations that cannot work are refused before anything starts, and a worker's KV pool is the neediest rank's
plan (shared/engine/kv_pool_size.plan_rank_pools)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.shapes import SHAPES, build_shape_checkpoint
from shared.engine.errors import MemoryBudgetError
from shared.engine.kv_pool_size import plan_rank_pools
from shared.engine.memory_budget import GIB, MemoryProfile, plan_kv_pool
from shared.launcher.gpu_plan import NCCL_BYTES, WORKER_DEFAULTS, PlanError, plan_mesh, worker_needs
from shared.launcher.process_spec import MeshOptions, mesh_services, placement
from shared.models.model_config import load_model_config

GB = 10**9


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory) -> Path:
    shape = replace(SHAPES["llama-3.1-70b"], write_weights=False)
    return Path(build_shape_checkpoint(str(tmp_path_factory.mktemp("tp-plan") / "70b"), shape))


def _engine_procs(opts: MeshOptions) -> dict:
    return {p.name: p for s in mesh_services(opts) if s.service in ("decode", "prefill")
            for p in s.processes(sys.executable, {})}


def test_each_rank_gets_its_own_gpu_and_the_flags() -> None:
    opts = MeshOptions(model="m", decode=1, prefill=1, devices=("0", "1", "2", "3"), decode_tp=2, prefill_tp=2)
    procs = _engine_procs(opts)
    assert procs["decode-0"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert procs["prefill-0"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    for name in ("decode-0", "prefill-0"):
        argv = procs[name].argv
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"  # alone on its GPUs


def test_ranks_sharing_a_gpu_split_it_and_a_worker_takes_its_smallest_share() -> None:
    where = placement(MeshOptions(model="m", decode=2, prefill=1, devices=("0", "1"), decode_tp=2,
                                  gpu_memory_utilization=0.8))
    assert {n: p.device for n, p in where.items()} == {"decode-0": "0,1", "decode-1": "0,1", "prefill-0": "0"}
    # GPU 0: two decode ranks (2 parts each) + the prefill worker (1 part) of 0.8; GPU 1: two decode ranks.
    assert where["decode-0"].gpu_memory_utilization == 0.32 and where["prefill-0"].gpu_memory_utilization == 0.16
    for dev in ("0", "1"):
        assert sum(p.gpu_memory_utilization for p in where.values() if dev in p.devices) <= 0.8


def test_impossible_layouts_are_refused_with_the_fix() -> None:
    with pytest.raises(AssertionError, match=r"--decode-tp 4 needs 4 GPUs, one per rank, but --devices gives 2"):
        MeshOptions(model="m", devices=("0", "1"), decode_tp=4)
    with pytest.raises(AssertionError, match="--prefill-tp 2 needs 2 GPUs"):
        MeshOptions(model="m", devices=("0",), prefill_tp=2)
    MeshOptions(model="m", devices=("0",), prefill=0, prefill_tp=2)  # no prefill workers: nothing to place
    with pytest.raises(AssertionError, match="--engine sim runs no model"):
        MeshOptions(model="m", engine="sim", decode_tp=2)


def test_the_gpu_plan_is_per_rank(llama70b) -> None:
    """Llama-3.1-70B in bf16 (141 GB of weights) fits no 80 GB GPU alone; at TP=4 each rank holds a quarter of the
    weights and of the KV heads (8 KV heads: 2 a rank) plus NCCL, and the plan says so."""
    d = WORKER_DEFAULTS
    needs = worker_needs(load_model_config(llama70b), "auto", "auto", d.max_num_batched_tokens, d.max_num_seqs)
    rank = needs.per_rank(4)
    assert rank.weights == -(-needs.weights // 4) and rank.kv_per_token == needs.kv_per_token // 4
    assert rank.overhead == needs.overhead + NCCL_BYTES and rank.activations == needs.activations
    assert needs.per_rank(16).kv_per_token == needs.kv_per_token // 8  # 8 KV heads on 16 ranks: replicated
    gpus = {str(i): 80 * GB for i in range(8)}
    plan = plan_mesh(MeshOptions(devices=tuple(gpus), decode=1, prefill=1, decode_tp=4, prefill_tp=4), gpus, needs,
                     131072, layout_given=True)
    assert plan.fits and [(w.device, w.tp) for w in plan.workers] == [("0,1,2,3", 4), ("4,5,6,7", 4)]
    assert plan.workers[0].need == rank.total(plan.max_model_len)
    assert "per rank" in plan.table()
    with pytest.raises(PlanError, match="the model does not fit"):  # what TP is for: one GPU cannot hold it
        plan_mesh(MeshOptions(devices=("0",), decode=1, prefill=0), {"0": 80 * GB}, needs, 131072)


def test_kv_pool_is_the_neediest_ranks_plan() -> None:
    total = 80 * GIB
    roomy = MemoryProfile(total, total, 10 * GIB, 2 * GIB, GIB, 0)
    shared_gpu = MemoryProfile(total, total // 2, 10 * GIB, 2 * GIB, GIB, 0)  # another worker holds half this GPU
    per_block = 1 << 20
    assert plan_rank_pools([roomy], 0.4, per_block, 16) == plan_kv_pool(roomy, 0.4, per_block, 16).num_blocks
    assert plan_rank_pools([roomy, roomy], 0.9, per_block, 16) == plan_kv_pool(roomy, 0.9, per_block, 16).num_blocks
    with pytest.raises(MemoryBudgetError, match=r"tensor-parallel rank 1: --gpu-memory-utilization 0.9 asks for"):
        plan_rank_pools([roomy, shared_gpu], 0.9, per_block, 16)
    fat = MemoryProfile(total, total, 10 * GIB, 20 * GIB, GIB, 0)  # a rank with bigger activations
    assert plan_rank_pools([roomy, fat], 0.45, per_block, 16) == plan_kv_pool(fat, 0.45, per_block, 16).num_blocks
