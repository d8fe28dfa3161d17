r"""`kvmesh bench llamacpp`: llama.cpp's `llama-server` on a GGUF file, the CPU baseline kvmesh is measured against.

    kvmesh bench llamacpp --gguf model.gguf --port 8002 [--threads 2 --parallel 32]

llama.cpp is not a Python package: `llama-server` is built once from the `llama-cpp-python` sdist on the
package registry (its vendor/llama.cpp) and cached outside the repository, in ~/.cache/kvmesh/llamacpp:

    kvmesh bench llamacpp --build        # about 20 minutes on 2 cores

The build turns GGML_NATIVE off and AVX2/AVX512/AVX512-VNNI/AVX512-BF16 on, AMX off: on the project's
machine `GGML_NATIVE=ON` produced code that dies with an illegal instruction on Q4 models. The server is
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

CACHE = Path(os.environ.get("KVMESH_LLAMACPP_DIR", Path.home() / ".cache" / "kvmesh" / "llamacpp"))
SDIST = "llama-cpp-python"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
               "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_OPENMP=ON"]


def server_binary() -> Path | None:
    """The cached llama-server (or $KVMESH_LLAMA_SERVER), or None."""
    env = os.environ.get("KVMESH_LLAMA_SERVER")
    if env:
        return Path(env)
    found = sorted(CACHE.glob("*/vendor/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else None


def source_version(binary: Path) -> str:
    """The llama-cpp-python sdist the binary was built from (its vendored llama.cpp)."""
    for parent in binary.parents:
        if parent.name.startswith("llama_cpp_python-"):
            return parent.name.removeprefix("llama_cpp_python-")
    return "unknown"


def build(jobs: int = os.cpu_count() or 2) -> Path:
    """Download the sdist, build llama-server with the flags above, return its path."""
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
                    str(CACHE), "-q"], check=True)
    sdist = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1]
    src = CACHE / sdist.name.removesuffix(".tar.gz")
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(CACHE, filter="data")
    tree = src / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(jobs)], cwd=tree, check=True)
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


def run(args: argparse.Namespace) -> int:
    if args.build:
        if shutil.which("cmake") is None:
            print("kvmesh bench llamacpp: cmake is needed to build llama-server", file=sys.stderr)
            return 1
        print(f"built: {build()}", flush=True)
    if not args.gguf:
        return 0 if args.build else 2
    cfg = LlamaCppConfig(args.gguf, args.port, args.host, args.threads, args.parallel, args.ctx_per_slot, args.alias)
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
