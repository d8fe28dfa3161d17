"""A follower rank's process: `python -m shared.engine.tp.worker_main --rank R --size N --init file://...
--config-file PATH`, started by shared/engine/tp/launch.py (the config, with the mesh's secret, is read from
rank 0's private file: never on the command line). It loads its weight shard, then follows rank 0.

This entry point computes only: a worker that moves KV rank to rank starts its ranks through
services/tp_rank.py, which calls main() with the data plane."""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

import torch

from shared.engine.cuda_device import use_device
from shared.engine.model_runner import ModelRunner
from shared.engine.tp.follower import follow
from shared.engine.tp.rank_memory import RankMemory
from shared.engine.tp.shard_link import ShardTransport
from shared.engine.tp.launch import join_groups, rank_device, read_config
from shared.models.loader import load_model

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux), so no rank outlives its engine."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed connections still end the follower
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)


def main(argv: list[str] | None = None, shard_transport: Callable[[], ShardTransport] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--config-file", required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    # A supervisor's SIGTERM / a terminal's Ctrl-C reach the whole process group; rank 0 drains first (its
    # offload still gathers KV from this rank) and then stops this rank: STOP, or dying takes it along.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    c = read_config(args.config_file)
    device = rank_device(c.device, args.rank)
    use_device(device)
    memory = RankMemory.at_start(device)  # before the weights: the memory profile's start (CUDA only)
    tp, channel = join_groups(args.rank, args.size, args.init, c.device)
    model, _ = load_model(c.model, dtype=c.dtype, device=device, load_format=c.load_format, seed=c.seed,
                          max_positions=c.max_model_len, quantization=c.quantization,
                          pack_weights=c.cpu_weight_packing, tp=tp)
    memory.loaded()
    follow(ModelRunner(model, c.block_size, device), channel, args.rank, args.size, memory, shard_transport)
    return 0


if __name__ == "__main__":
    sys.exit(main())
