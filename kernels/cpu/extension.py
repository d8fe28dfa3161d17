"""Builds and loads the C++ CPU kernels of this folder (one .cpp per kernel, registered as torch.ops.kvmesh_cpu.*).

Compiled at runtime with torch.utils.cpp_extension.load on the first use in a process, into a cache outside the
repository ($KVMESH_TORCH_EXT_DIR, else ~/.cache/kvmesh/torch_ext), one folder per hash of the sources, flags and
torch version: a clean checkout compiles once (about a minute on 2 cores), later processes only load the library.
The sources are copied into that folder and compiled from there, so every checkout on the machine (a CI clone, a
git worktree) with the same sources shares one build instead of each rebuilding it (ninja keys on source paths).
Builders serialise on an flock of the folder, which the kernel drops when a process dies: a build killed half way
(Ctrl-C in `make venv`) leaves torch's own lock file behind, and every later load would wait on it for ever, so
whoever holds the flock removes that file as stale first.
Flags follow the CPU: AVX-512 (with BF16 / VNNI when /proc/cpuinfo lists them) and FMA/AVX2 where present, never
-march=native (it would also switch on AMX, which this project's CPUs advertise but must not use), plain -O3
elsewhere. A missing compiler or a failed build is logged once and the callers keep the torch path.

KVMESH_CPU_KERNELS=torch turns the C++ path off (native, the default, uses it when it builds).
KVMESH_CPU_ISA emulates a smaller CPU on a bigger one: `avx2` drops every AVX-512 flag (and with them AVX512-BF16,
so shared/models/cpu_dtype.py also serves as on a CPU without native bf16), `generic` drops all vector flags; the
default `native` takes /proc/cpuinfo as it is. Each choice builds its own library (the flags are in the hash).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ENV = "KVMESH_CPU_KERNELS"
MODES = ("native", "torch")
# /proc/cpuinfo flag -> g++ flag. AVX-512 only when the foundation, BW and VL sets are all there (the compiler
# vectorises 16-bit loads with BW, 256-bit ops with VL).
_ISA = (("avx2", "-mavx2"), ("fma", "-mfma"), ("f16c", "-mf16c"), ("avx512f", "-mavx512f"),
        ("avx512bw", "-mavx512bw"), ("avx512vl", "-mavx512vl"), ("avx512dq", "-mavx512dq"),
        ("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni"))

ISA_ENV = "KVMESH_CPU_ISA"
ISAS = ("native", "avx2", "generic")

_lock = threading.Lock()


def isa() -> str:
    mode = os.environ.get(ISA_ENV, "native") or "native"
    if mode not in ISAS:
        raise ValueError(f"{ISA_ENV}={mode!r}: choose one of {', '.join(ISAS)}")
    return mode


def mask_flags(have: set[str]) -> set[str]:
    """The /proc/cpuinfo flags as KVMESH_CPU_ISA lets the kernels (and the dtype choice) see them."""
    mode = isa()
    if mode == "avx2":
        return {f for f in have if not f.startswith(("avx512", "amx"))}
    if mode == "generic":
        return {f for f in have if not f.startswith(("avx", "amx", "fma", "f16c"))}
    return have
_state: tuple[bool, str] | None = None


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Compiler flags for this CPU's vector extensions (from /proc/cpuinfo; none where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    have = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    have = mask_flags(have)
    flags = [f for name, f in _ISA if name in have]
    if not {"avx512f", "avx512bw", "avx512vl"} <= have:
        flags = [f for f in flags if not f.startswith("-mavx512")]
    return flags


def sources() -> list[Path]:
    return sorted(HERE.glob("*.cpp"))


def _all_files() -> list[Path]:
    return sources() + sorted(HERE.glob("*.h"))


def _stage_sources(build_dir: Path) -> list[str]:
    """The sources as copies under build_dir/src (written once: the folder's name is their hash), the .cpp paths."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for p in _all_files():
        dst, data = src / p.name, p.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = dst.with_suffix(dst.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)  # atomic: a concurrent reader sees the old file or the new, never half
    return [str(src / p.name) for p in sources()]


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Exclusive among this machine's processes for the build folder; a holder that died released it."""
    with open(build_dir / "kvmesh.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            # Every builder of this folder goes through this flock, so torch's lock file (cpp_extension's FileBaton)
            # present now was left by a build that died: it would make load() wait on it for ever.
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_dir(flags: list[str]) -> tuple[str, Path]:
    h = hashlib.sha256()
    for p in _all_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    name = f"kvmesh_cpu_{h.hexdigest()[:12]}"
    root = Path(os.environ.get("KVMESH_TORCH_EXT_DIR", Path.home() / ".cache" / "kvmesh" / "torch_ext"))
    return name, root / name


def requested() -> str:
    mode = os.environ.get(ENV, "native")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def _load() -> tuple[bool, str]:
    if requested() == "torch":
        return False, f"{ENV}=torch"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler or not shutil.which(compiler):
        return False, "no C++ compiler (c++ / g++ / $CXX) on PATH"
    try:
        from torch.utils import cpp_extension
    except Exception as e:  # noqa: BLE001 - a torch without its build helpers: keep the torch path
        return False, f"torch.utils.cpp_extension unavailable: {e}"
    flags = cpu_flags()
    name, build_dir = _build_dir(flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            cpp_extension.load(name=name, sources=_stage_sources(build_dir), build_directory=str(build_dir),
                               extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build or load failure: keep the torch path, say why once
        return False, f"building the C++ CPU kernels failed ({type(e).__name__}: {str(e)[-2000:]})"
    _register_fakes()
    return True, f"C++ CPU kernels ({' '.join(flags) or 'no vector flags'}) from {build_dir}"


def _register_fakes() -> None:
    """Output shapes of the ops the eager model calls, so a step through them can be traced (--cpu-compile)."""
    from kernels.cpu.gemv_bf16 import linear_w16_fake
    from kernels.cpu.gemv_dpbf16 import linear_dpbf16_fake
    from kernels.cpu.gemv_gguf import linear_gguf_fake

    for name, fake in (("kvmesh_cpu::linear_w16", linear_w16_fake), ("kvmesh_cpu::linear_gguf", linear_gguf_fake),
                       ("kvmesh_cpu::linear_dpbf16", linear_dpbf16_fake)):
        torch.library.register_fake(name)(fake)


def native_status() -> tuple[bool, str]:
    """(the C++ kernels are loaded?, why / what), built or loaded on the first call; logged once."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
            (log.info if _state[0] else log.warning)("CPU kernels: %s", _state[1] if _state[0] else
                                                     f"torch twins ({_state[1]})")
        return _state


def native_available() -> bool:
    return native_status()[0]


if __name__ == "__main__":
    # `make venv` builds the kernels once at install (so no worker's start pays the compile); never fails the
    # install: without a compiler the engine keeps the torch path, and says so.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    native_status()
