"""What a tensor-parallel engine asks of torch on CUDA, checked as arguments on this CPU machine: NCCL process
groups bound to each rank's own GPU, gloo ones unbound, and every CUDA graph captured with thread-local capture
errors (NCCL's watchdog thread keeps querying events while the engine thread captures)."""
from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as dist

from shared.engine.graph_capture import capture_kwargs
from shared.engine.tp.launch import COMPUTE_TIMEOUT_S, process_group_kwargs


@pytest.mark.parametrize(("device", "rank", "bound"), [("cuda", 0, 0), ("cuda", 1, 1), ("cuda:2", 0, 2),
                                                       ("cuda:2", 1, 3), ("cuda:0", 3, 3)])
def test_nccl_groups_are_bound_to_the_ranks_own_gpu(device, rank, bound):
    kwargs = process_group_kwargs(rank, 4, "tcp://127.0.0.1:1", device)
    assert kwargs["backend"] == "cpu:gloo,cuda:nccl"
    assert kwargs["device_id"] == torch.device("cuda", bound) and kwargs["device_id"].index == bound
    assert (kwargs["rank"], kwargs["world_size"], kwargs["init_method"]) == (rank, 4, "tcp://127.0.0.1:1")
    assert kwargs["timeout"] == datetime.timedelta(seconds=COMPUTE_TIMEOUT_S)


def test_gloo_groups_name_no_device():
    kwargs = process_group_kwargs(1, 2, "tcp://127.0.0.1:1", "cpu")
    assert kwargs["backend"] == "gloo" and "device_id" not in kwargs


def test_this_torch_takes_every_argument_chosen():
    assert set(process_group_kwargs(1, 2, "tcp://x:1", "cuda")) <= set(inspect.signature(dist.init_process_group)
                                                                        .parameters)
    assert set(capture_kwargs()) <= set(inspect.signature(torch.cuda.graph.__init__).parameters)


def test_graphs_capture_with_thread_local_errors_and_share_the_pool_given():
    pool = object()
    assert capture_kwargs(pool) == {"pool": pool, "capture_error_mode": "thread_local"}
    assert capture_kwargs()["pool"] is None


def test_every_capture_in_the_engine_goes_through_capture_kwargs():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [p for d in ("shared", "kernels", "services") for p in (root / d).rglob("*.py")]
    captures = [p for p in sources if "torch.cuda.graph(" in p.read_text()]
    assert captures, "the engine captures CUDA graphs somewhere"
    for path in captures:
        for line in path.read_text().splitlines():
            if "torch.cuda.graph(" in line:
                assert "capture_kwargs(" in line, f"{path.relative_to(root)}: {line.strip()}"
