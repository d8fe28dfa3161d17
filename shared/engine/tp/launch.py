"""Starting and stopping a tensor-parallel engine's follower ranks, from rank 0.

Followers are plain subprocesses (`python -m shared.engine.tp.worker_main`) given the engine config as JSON, so
nothing is pickled. The config holds the mesh's cache salt, so it is never on a command line (any local user
reads /proc/*/cmdline): it goes through a 0600 file in a 0700 directory of rank 0's, removed once every rank
has joined. The rendezvous is a torch FileStore in that same directory rather than a TCPStore (which listens
on every interface, unauthenticated), and gloo's own connections stay on the loopback interface (the ranks
share one host). Rank 0 joins the process group with them on the thread that will
compute (torch.distributed's default group is per process: one TP engine per process at a time). A follower
that dies makes rank 0's next collective fail at once (gloo sees the closed connection); `guard` turns that
into one clear error and takes the other ranks down, and followers die with rank 0 (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shared.config import EngineConfig
from shared.engine.tp.channel import TPChannel
from shared.engine.tp.step_message import Header, Op
from shared.models.model_config import load_model_config
from shared.models.tp.degree import check_degree
from shared.models.tp.group import TPGroup
from shared.private_dir import open_private

log = logging.getLogger(__name__)

# A collective that has not finished in this long is stuck (a rank hung, not dead: dead ones fail at once).
COMPUTE_TIMEOUT_S = float(os.environ.get("KVMESH_TP_TIMEOUT_S", 120))
# Followers wait for the next step on the control group while the engine idles, for as long as it idles.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
STOP_WAIT_S = 10.0
# What a follower rank runs when the engine's owner names nothing else: compute only, no data plane for
# rank-to-rank KV (a mesh worker names its own entry point, which brings one).
COMPUTE_FOLLOWER = "shared.engine.tp.worker_main"
CONFIG_FILE = "engine.json"
RENDEZVOUS_FILE = "rendezvous"
LOOPBACK = "lo"


class TPRankError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(first + r) on CUDA, the CPU otherwise."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def backend_for(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    raw = json.loads(text)
    if raw.get("gpu_capability") is not None:
        raw["gpu_capability"] = tuple(raw["gpu_capability"])
    return EngineConfig(**raw)


def write_config(directory: Path, config: EngineConfig) -> Path:
    """The config as a 0600 file in rank 0's private directory (it holds the cache salt)."""
    path = directory / CONFIG_FILE
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
        f.write(config_to_json(config))
    return path


def read_config(path: str | Path) -> EngineConfig:
    with os.fdopen(open_private(path, os.O_RDONLY), "r") as f:
        return config_from_json(f.read())


def keep_gloo_on_loopback() -> None:
    """Gloo's pair connections on the loopback interface (inherited by the followers): all ranks are on this host,
    and nothing off it needs to reach them. An explicit GLOO_SOCKET_IFNAME is left alone."""
    if os.path.exists(f"/sys/class/net/{LOOPBACK}"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)


def process_group_kwargs(rank: int, size: int, init_method: str, device: str) -> dict[str, Any]:
    """init_process_group's arguments for rank `rank` of an engine on `device` (the engine's, rank 0's). With NCCL
    the group is bound to the rank's own GPU (device_id): its communicator is made for that GPU at once, rather
    than for whatever device is current when the first collective runs, and barriers know their device."""
    kwargs: dict[str, Any] = dict(backend=backend_for(device), init_method=init_method, rank=rank, world_size=size,
                                  timeout=datetime.timedelta(seconds=COMPUTE_TIMEOUT_S))
    if "nccl" in kwargs["backend"]:
        kwargs["device_id"] = torch.device(rank_device(device, rank))
    return kwargs


def join_groups(rank: int, size: int, init_method: str, device: str) -> tuple[TPGroup, TPChannel]:
    """Join the process group (the compute group: the model's collectives and payloads) and make the control
    group; every rank calls this in the same order, on its compute thread with its GPU current."""
    dist.init_process_group(**process_group_kwargs(rank, size, init_method, device))
    control = dist.new_group(list(range(size)), timeout=CONTROL_TIMEOUT, backend="gloo")
    compute = dist.group.WORLD
    return TPGroup(rank, size, compute), TPChannel(control, compute, device)


class TPWorkers:
    """Rank 0's handle on its followers: the group, the channel, the processes and their one shutdown path."""

    def __init__(self, config: EngineConfig, follower_main: str = COMPUTE_FOLLOWER) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (torch.distributed is initialised)")
        self.size = config.tensor_parallel_size
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-tp-"))  # 0700: the config file and the rendezvous
        init = f"file://{self.dir / RENDEZVOUS_FILE}"
        config_path = write_config(self.dir, config)
        keep_gloo_on_loopback()
        # Each rank gets an equal share of rank 0's CPU threads (they would otherwise all take every core).
        threads = max(1, torch.get_num_threads() // self.size)
        self.procs = [subprocess.Popen([sys.executable, "-m", follower_main, "--rank", str(r),
                                        "--size", str(self.size), "--init", init, "--parent", str(os.getpid()),
                                        "--threads", str(threads), "--config-file", str(config_path)])
                      for r in range(1, self.size)]
        atexit.register(self.kill)
        self.failed = False
        self.closed = False  # the group left (a later engine in this process may have its own by then)
        self._threads_before = torch.get_num_threads()  # given back at shutdown
        try:
            self.group, self.channel = join_groups(0, self.size, init, config.device)
        except Exception as e:
            dead = self.dead()  # a follower that failed to start leaves the rendezvous waiting for its timeout
            self.kill()
            raise TPRankError(f"tensor-parallel ranks did not join: {'; '.join(dead) or e}") from e
        config_path.unlink(missing_ok=True)  # every follower read it before joining
        torch.set_num_threads(threads)
        log.info("tensor parallel: %d ranks (followers pids %s)", self.size, [p.pid for p in self.procs])

    def dead(self) -> list[str]:
        return [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def check_alive(self) -> None:
        """Raise TPRankError (taking the other ranks down) if a follower has exited."""
        dead = self.dead()
        if dead and not self.closed:
            self.failed = True
            self.kill()
            raise TPRankError(f"tensor-parallel rank died while the engine was idle: {'; '.join(dead)}")

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run rank 0's side of an operation; a failed collective takes every rank down with one clear error."""
        if self.failed:
            raise TPRankError(f"tensor-parallel engine already failed; not {what}")
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as e:
            if isinstance(e, (NotImplementedError, TPRankError)):
                raise
            self.failed = True
            dead = self.dead()
            self.kill()
            raise TPRankError(f"tensor parallelism failed while {what}: "
                              f"{'; '.join(dead) if dead else 'a collective failed'} ({e})") from e

    def shutdown(self) -> None:
        """Tell the followers to stop and wait for them (killing any that do not), then leave the group; once."""
        if self.closed:
            return
        if not self.failed and not self.dead():
            try:
                self.channel.send(Header(Op.STOP))
            except RuntimeError:
                log.warning("tensor parallel: a follower was gone at shutdown")
        for p in self.procs:
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if not self.closed and dist.is_initialized():
            dist.destroy_process_group()
            torch.set_num_threads(self._threads_before)
        shutil.rmtree(self.dir, ignore_errors=True)  # the rendezvous file (and the config, if never read)
        self.closed = True
        atexit.unregister(self.kill)


def start_tensor_parallel(c: EngineConfig, follower_main: str = COMPUTE_FOLLOWER) -> TPWorkers:
    """Rank 0's follower ranks for config c, started once the degree and the devices are checked: a bad degree
    fails before any process starts. follower_main: the module each follower runs (`python -m`)."""
    check_degree(load_model_config(c.model), c.tensor_parallel_size)
    if c.device.startswith("cuda"):
        last = rank_device(c.device, c.tensor_parallel_size - 1)
        if int(last.split(":")[1]) >= torch.cuda.device_count():
            raise ValueError(f"tensor-parallel size {c.tensor_parallel_size} from {c.device} needs {last}, but "
                             f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return TPWorkers(c, follower_main)
