"""A tensor-parallel engine as another local user sees it: the engine config carries the mesh's cache salt, and
every local user reads /proc/*/cmdline; torch's TCPStore listened on every interface without authentication.
A real TP=2 engine (rank 0 here, rank 1 a follower process) must put the salt on no command line and in no
file anyone else can read, and listen on no non-loopback address."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.engine_helpers import greedy, make_engine, random_prompts

SALT = "mesh-secret-0123456789abcdef"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pid: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets process `pid` listens on."""
    mine = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # 0A: LISTEN
                found.append(fields[1])
    return found


def _loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return ip.endswith("7F")
    return ip in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_the_salt_is_on_no_command_line_and_the_ranks_listen_on_loopback_only(checkpoints) -> None:  # noqa: ANN001
    engine = make_engine(checkpoints["llama"], tensor_parallel_size=2, cache_salt=SALT)
    try:
        follower = engine.tp.procs[0]
        for pid in (follower.pid, os.getpid()):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert SALT.encode() not in cmdline, f"the cache salt is on pid {pid}'s command line"
        # Nothing left on disk holds the config once the ranks joined; what the rendezvous keeps is private.
        private = engine.tp.dir
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        for path in private.iterdir():
            assert SALT.encode() not in path.read_bytes(), f"{path} still holds the salt"
        for pid in (follower.pid, os.getpid()):
            exposed = [a for a in _listening(pid) if not _loopback(a)]
            assert not exposed, f"pid {pid} listens on non-loopback addresses {exposed}"
        # And it computes (the file rendezvous carries the groups the steps use).
        engine.add_request("r", random_prompts([9], seed=3)[0], greedy(4))
        for _ in range(20):
            engine.step()
    finally:
        engine.shutdown()
    assert not private.exists(), "rank 0 leaves its rendezvous directory behind"
