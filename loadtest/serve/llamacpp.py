r"""`kvmesh bench llamacpp`: llama.cpp's `llama-server` on a GGUF file, the CPU baseline kvmesh is measured against.

    kvmesh bench llamacpp --gguf model.gguf --port 8002 [--threads 2 --parallel 32]

llama.cpp is not a Python package: `llama-server` is built once from the `llama-cpp-python` sdist on the
package registry (its vendor/llama.cpp) and cached outside the repository, one build per instruction set, in
~/.cache/kvmesh/llamacpp-<isa> (or $KVMESH_LLAMACPP_DIR):

    kvmesh bench llamacpp --build              # about 20 minutes on 2 cores; this CPU's instruction set
    kvmesh bench llamacpp --build --isa avx2   # an AVX2-only build, as an AVX2 CPU would run it

The build turns GGML_NATIVE off (on the project's machine `GGML_NATIVE=ON` produced code that dies with an
illegal instruction on Q4 models) and each x86 extension on only when /proc/cpuinfo lists it (AVX, AVX2, FMA,
F16C, BMI2, SSE4.2, AVX512 F/BW/VL/DQ/CD, VNNI, BF16; AMX off): a build never runs instructions its CPU lacks. `--isa` masks
the CPU's set down (avx512 > avx2 > avx > generic), and `--isa` when serving picks that build. The server is
started with one slot per concurrent request (`-np`), a context of `--ctx-per-slot` tokens each, and the
GGUF's own chat template; it honours `ignore_eos`, so `bench serve --eos-mode ignore_eos` works against it.
The model name it answers to is `--alias` (default: the GGUF file's stem).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.serve.baseline import BaselineServer, launch

CACHE_ROOT = Path.home() / ".cache" / "kvmesh"
SDIST = "llama-cpp-python"
COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512_VBMI=OFF", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_OPENMP=ON"]
ISA_LEVELS = ("generic", "avx", "avx2", "avx512")
# ggml's x86 switch -> the /proc/cpuinfo flags it needs, and the lowest --isa level that keeps it.
# (ggml defaults SSE4.2, AVX, AVX2, BMI2, FMA and F16C to ON when GGML_NATIVE is off: each is set explicitly.)
GGML_FEATURES = {"GGML_SSE42": (("sse4_2",), "avx"), "GGML_AVX": (("avx",), "avx"), "GGML_BMI2": (("bmi2",), "avx2"), "GGML_F16C": (("f16c",), "avx2"), "GGML_FMA": (("fma",), "avx2"),
                 "GGML_AVX2": (("avx2",), "avx2"),
                 "GGML_AVX512": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"), "avx512"),
                 "GGML_AVX512_VNNI": (("avx512_vnni",), "avx512"), "GGML_AVX512_BF16": (("avx512_bf16",), "avx512")}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@dataclass(frozen=True)
class IsaBuild:
    """The x86 extensions a llama.cpp build uses: what this CPU has, masked down to at most `cap`."""

    features: tuple[str, ...]  # GGML_* switches turned on

    @classmethod
    def for_cpu(cls, flags: set[str], cap: str | None = None) -> IsaBuild:
        if cap is not None and cap not in ISA_LEVELS:
            raise ValueError(f"--isa {cap}: one of {', '.join(ISA_LEVELS)}")
        top = ISA_LEVELS.index(cap) if cap else len(ISA_LEVELS) - 1
        on = []
        for switch, (needs, level) in GGML_FEATURES.items():
            if ISA_LEVELS.index(level) <= top and all(f in flags for f in needs):
                if switch.startswith("GGML_AVX512_") and "GGML_AVX512" not in on:
                    continue
                on.append(switch)
        return cls(tuple(on))

    @property
    def name(self) -> str:
        """The cache directory's tag: avx512[-vnni][-bf16], avx2, avx or generic."""
        on = set(self.features)
        if "GGML_AVX512" in on:
            return "-".join(["avx512"] + [x for x, s in (("vnni", "GGML_AVX512_VNNI"), ("bf16", "GGML_AVX512_BF16"))
                                          if s in on])
        if {"GGML_AVX2", "GGML_FMA", "GGML_F16C"} <= on:
            return "avx2"
        return "avx" if "GGML_AVX" in on else "generic"

    def cmake_flags(self) -> list[str]:
        return COMMON_FLAGS + [f"-D{s}={'ON' if s in self.features else 'OFF'}" for s in GGML_FEATURES]


def host_isa(cap: str | None = None) -> IsaBuild:
    return IsaBuild.for_cpu(cpu_flags(), cap)


def cache_dir(isa: IsaBuild) -> Path:
    """Where the build for `isa` lives: ~/.cache/kvmesh/llamacpp-<isa> ($KVMESH_LLAMACPP_DIR: that one place)."""
    env = os.environ.get("KVMESH_LLAMACPP_DIR")
    return Path(env) if env else CACHE_ROOT / f"llamacpp-{isa.name}"


def _built(directory: Path) -> Path | None:
    found = sorted(directory.glob("*/vendor/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else None


def server_binary(cap: str | None = None) -> Path | None:
    """$KVMESH_LLAMA_SERVER, or the cached llama-server this CPU runs best (the build for its instruction set
    masked to `cap`, else a build for a smaller set it also runs), or None."""
    env = os.environ.get("KVMESH_LLAMA_SERVER")
    if env:
        return Path(env)
    if os.environ.get("KVMESH_LLAMACPP_DIR"):
        return _built(Path(os.environ["KVMESH_LLAMACPP_DIR"]))
    flags = cpu_flags()
    top = ISA_LEVELS.index(cap) if cap else len(ISA_LEVELS) - 1
    for level in reversed(ISA_LEVELS[:top + 1]):
        if (found := _built(cache_dir(IsaBuild.for_cpu(flags, level)))) is not None:
            return found
    return None


def binary_isa(binary: Path) -> str:
    """The instruction-set tag of a cached build (from its cache directory's name), or "unknown"."""
    for parent in binary.parents:
        if parent.name.startswith("llamacpp-"):
            return parent.name.removeprefix("llamacpp-")
    return "unknown"


def source_version(binary: Path) -> str:
    """The llama-cpp-python sdist the binary was built from (its vendored llama.cpp)."""
    for parent in binary.parents:
        if parent.name.startswith("llama_cpp_python-"):
            return parent.name.removeprefix("llama_cpp_python-")
    return "unknown"


def build(jobs: int = os.cpu_count() or 2, cap: str | None = None) -> Path:
    """Download the sdist, build llama-server and llama-bench for this CPU's instruction set (masked to `cap`)
    into its own cache directory, return the server's path."""
    isa = host_isa(cap)
    cache = cache_dir(isa)
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
                    str(cache), "-q"], check=True)
    sdist = sorted(cache.glob("llama_cpp_python-*.tar.gz"))[-1]
    src = cache / sdist.name.removesuffix(".tar.gz")
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(cache, filter="data")
    tree = src / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-B", "build", *isa.cmake_flags()], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-bench", "-j", str(jobs)],
                   cwd=tree, check=True)
    return tree / "build" / "bin" / "llama-server"


@dataclass(frozen=True)
class LlamaCppConfig:
    gguf: str
    port: int = 8002
    host: str = "127.0.0.1"
    threads: int = os.cpu_count() or 2
    parallel: int = 32
    ctx_per_slot: int = 1024
    alias: str | None = None
    binary: str | None = None

    @property
    def model_name(self) -> str:
        return self.alias or Path(self.gguf).stem

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        binary = self.binary or server_binary()
        if binary is None:
            raise RuntimeError("no llama-server: run `kvmesh bench llamacpp --build` (about 20 minutes on 2 cores) "
                               "or set KVMESH_LLAMA_SERVER")
        return [str(binary), "-m", self.gguf, "--host", self.host, "--port", str(self.port), "-t", str(self.threads),
                "-tb", str(self.threads), "-np", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel),
                "--alias", self.model_name, "--jinja", "--no-webui"]


def start_llamacpp(config: LlamaCppConfig, ready_timeout: float = 120.0) -> BaselineServer:
    return launch(config, config.command(), "llama-server", ready_timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("--gguf", help="the GGUF file to serve (--model would be converted to a checkpoint directory)")
    p.add_argument("--build", action="store_true", help="build llama-server into the cache first")
    p.add_argument("--port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--parallel", type=int, default=32, help="slots: concurrent requests")
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--alias", help="model name in the API (default: the file's stem)")
    p.add_argument("--isa", choices=ISA_LEVELS, default=None,
                   help="build (and serve) for at most this instruction set, e.g. avx2 to emulate an AVX2 CPU on an "
                        "AVX512 one (default: everything /proc/cpuinfo lists)")


def run(args: argparse.Namespace) -> int:
    if args.build:
        if shutil.which("cmake") is None:
            print("kvmesh bench llamacpp: cmake is needed to build llama-server", file=sys.stderr)
            return 1
        print(f"built: {build(cap=args.isa)}", flush=True)
    if not args.gguf:
        return 0 if args.build else 2
    binary = server_binary(args.isa)
    cfg = LlamaCppConfig(args.gguf, args.port, args.host, args.threads, args.parallel, args.ctx_per_slot, args.alias,
                         str(binary) if binary else None)
    try:
        server = start_llamacpp(cfg)
    except RuntimeError as e:
        print(f"kvmesh bench llamacpp: {e}", file=sys.stderr)
        return 1
    print(f"ready: --base-url {cfg.base_url} --model {cfg.model_name}  (log: {server.log_path}); Ctrl-C stops it",
          flush=True)
    try:
        while server.process.poll() is None:
            time.sleep(1.0)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
