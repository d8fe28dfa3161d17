"""`make gpu-wheels`: the wheels a GPU machine without a package index needs to run the mesh and the GPU check.

GPU images ship torch, triton, transformers, numpy, safetensors, tokenizers, msgpack and xxhash; the mesh's
messaging and HTTP stack (NATS client and server, pydantic, FastAPI, OpenTelemetry, openai) and the GGUF reader
are downloaded here, for the GPU machine's Python, at the versions installed in this environment (the ones the
tests ran with), into one folder to copy there.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

# What a GPU image brings: never shadowed by a downloaded wheel. Whatever torch, triton and numpy require is left
# out too (a binary build of another version could clash with the image's torch); other pure-Python packages
# are brought even when the image may have them, since its versions are unknown here.
PROVIDED = ["torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "accelerate", "matplotlib",
            "jinja2", "tqdm", "msgpack", "xxhash", "psutil", "huggingface-hub", "pyyaml", "regex"]


def _name(requirement: str) -> str | None:
    """The distribution a Requires-Dist line names, or None when it applies to an extra or another platform."""
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None
    return req.name


def closure(roots: list[str], stop: set[str] = frozenset()) -> set[str]:
    """The installed distributions `roots` need, themselves included (normalized names), not walking past `stop`."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen or name in stop:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [n for n in map(_name, requires) if n]
    return seen


def needed() -> list[str]:
    """kvmesh's requirements and theirs, less what the GPU image provides."""
    roots = [n for n in map(_name, metadata.requires("kvmesh") or []) if n]
    provided = {n.lower().replace("_", "-") for n in PROVIDED} | closure(["torch", "triton", "numpy"])
    return sorted(closure(roots, stop=provided))


PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def pinned(names: list[str]) -> list[str]:
    """name==version for each installed distribution (a missing one is left out, with a note)."""
    specs = []
    for name in names:
        try:
            specs.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"gpu-wheels: {name} is not installed here; left out", file=sys.stderr)
    return specs


def download_command(specs: list[str], python_version: str, dest: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_wheels", description=__doc__.splitlines()[0])
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    p.add_argument("--dest", default=".whl", help="folder for the wheels (default .whl)")
    args = p.parse_args(argv)
    rc = subprocess.call(download_command(pinned(needed()), args.python_version, args.dest))
    if rc == 0:
        print(f"gpu-wheels: wheels in {args.dest}; on the GPU machine: make gpu-check (installs them first)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
