"""What loading a 4-bit checkpoint costs on CPU next to the bf16 one: the Qwen3-0.6B shape (random weights in
bf16), written again as AWQ (group 128) and as GPTQ (group 128, with and without act order) in the published
formats by tests/quant_checkpoints.py, each loaded through shared/models/loader.py (read + repack into the served
layout, shared/models/w4a16.py) `--repeats` times; the best time of each, with the bytes on disk.

    PYTHONPATH=$PWD python loadtest/experiments/quant_load/quant_load_time.py --json loadtest/experiments/quant_load/results/quant_load_time.json
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

from loadtest.report_json import emit_report
from loadtest.shapes import SHAPES, build_shape_checkpoint
from loadtest.workload import machine_info
from shared.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests import quant_checkpoints as qc  # noqa: E402 - the writers of the published formats


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _time_load(path: Path, quantization: str | None, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model, _ = load_model(path, dtype="bfloat16", device="cpu", quantization=quantization)
        times.append(time.perf_counter() - t0)
        del model
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-quant-load-") as tmp:
        src = Path(build_shape_checkpoint(str(Path(tmp) / "bf16"), SHAPES[args.shape], seed=0))
        t0 = time.perf_counter()
        ckpts = {"bf16": (src, None),
                 "awq": (qc.write_quantized(src, Path(tmp) / "awq", "awq", qc.awq_config(args.group),
                                            group=args.group), "awq"),
                 "gptq": (qc.write_quantized(src, Path(tmp) / "gptq", "gptq", qc.gptq_config(args.group),
                                             group=args.group), "gptq"),
                 "gptq act order": (qc.write_quantized(src, Path(tmp) / "gptq-act", "gptq",
                                                       qc.gptq_config(args.group, desc_act=True), group=args.group,
                                                       desc_act=True), "gptq")}
        written = time.perf_counter() - t0
        rows = {}
        for name, (path, method) in ckpts.items():
            times = _time_load(path, method, args.repeats)
            rows[name] = {"load_s_best": round(min(times), 2), "load_s_all": [round(t, 2) for t in times],
                          "bytes_on_disk": _size(path)}
            print(f"{name}: {min(times):.2f} s ({_size(path) / 2**20:.0f} MiB)", file=sys.stderr, flush=True)
    base = rows["bf16"]["load_s_best"]
    for r in rows.values():
        r["vs_bf16"] = round(r["load_s_best"] / base, 2)
    emit_report({"experiment": "quant_load_time", "shape": args.shape, "group": args.group,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "torch_threads": torch.get_num_threads(), "checkpoints_written_s": round(written, 1),
                 "loads": rows, "machine": machine_info("cpu")}, args.json)


if __name__ == "__main__":
    main()
