r"""`kvmesh bench baseline`: Hugging Face `transformers serve --continuous-batching` on a local model dir.

This is the peer kvmesh is measured against on machines without vLLM/SGLang. It runs

    HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1 \
    python -m transformers.cli.transformers serve /abs/model/dir --continuous-batching \
        --device cpu --dtype float32 --host 127.0.0.1 --port P

(transformers >= 5 with `accelerate` installed: serve always passes a device_map, which needs it).
The server is pinned to that one model: requests must name it by the same string, the absolute
model directory, which is what `--model` of `bench serve` / `bench compare` must be. It rejects
unknown body fields, so `ignore_eos` gets HTTP 422; `bench serve --eos-mode auto` then falls
back to transformers' own `generation_config` field to force output lengths. /v1/completions
takes text prompts only (no token-id lists), so use `--prompt-kind text` against it.

Pointing `bench compare` at other servers (same checkpoint dir, same model name):

    vllm serve /abs/model/dir --port 8001            # vLLM: honours ignore_eos, takes token-id prompts
    python -m sglang.launch_server --model-path /abs/model/dir --port 8002   # SGLang: same
    kvmesh bench compare --a http://127.0.0.1:8001,/abs/model/dir,vllm \
                         --b http://127.0.0.1:8000,/abs/model/dir,transformers \
                         --sweep-concurrency 1,4,16,64 --input-len 32:512 --output-len 32:256
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class BaselineConfig:
    model_dir: str
    port: int = 8000
    host: str = "127.0.0.1"
    device: str = "cpu"
    dtype: str = "float32"
    # Unset, transformers sizes the paged cache from free memory on the first request, which took
    # ~14 s on a CPU box; a fixed small cache (tests) makes that first request take well under 1 s.
    cb_num_blocks: int | None = None
    cb_max_batch_tokens: int | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def model_name(self) -> str:
        return str(Path(self.model_dir).resolve())

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_name,
               "--continuous-batching", "--device", self.device, "--dtype", self.dtype,
               "--host", self.host, "--port", str(self.port), "--log-level", "warning"]
        if self.cb_num_blocks:
            cmd += ["--cb-num-blocks", str(self.cb_num_blocks)]
        if self.cb_max_batch_tokens:
            cmd += ["--cb-max-batch-tokens", str(self.cb_max_batch_tokens)]
        return cmd + list(self.extra_args)


@dataclass
class BaselineServer:
    """A running `transformers serve`. Use as a context manager, or call stop()."""

    config: BaselineConfig
    process: subprocess.Popen
    log_path: Path
    _log: object = field(repr=False, default=None)

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            # SIGTERM, not SIGINT: both are uvicorn's graceful path, but after SIGINT the CB worker
            # thread kept the process alive for over 10 s here; SIGTERM exits in about a second.
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)  # the server and anything it spawned
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "BaselineServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def start_baseline(config: BaselineConfig, ready_timeout: float = 180.0, log_path: str | Path | None = None) -> BaselineServer:
    """Start the server and return once /health answers 200; raise with the log tail if it dies or stalls."""
    assert (Path(config.model_dir) / "config.json").exists(), f"{config.model_dir}: not a model directory"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1")
    return launch(config, config.command(), "transformers serve", ready_timeout, log_path, env)


def launch(config, command: list[str], what: str, ready_timeout: float, log_path: str | Path | None = None,  # noqa: ANN001
           env: dict[str, str] | None = None) -> BaselineServer:
    """Start a baseline server (config: anything with base_url and model_name) in its own session, so stop()
    reaches whatever it starts besides itself; return once /health answers 200, else raise with the log tail."""
    if _healthy(config.base_url):
        raise RuntimeError(f"something already answers on {config.base_url}")
    prefix = what.replace(" ", "-") + "-"
    path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
    log = open(path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = BaselineServer(config, proc, path, log)
    end = time.monotonic() + ready_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{server.log_tail()}")
        if _healthy(config.base_url):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{what} not ready after {ready_timeout:g}s:\n{server.log_tail()}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("--model", required=True, help="local checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0, auto")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, auto")
    p.add_argument("--cb-num-blocks", type=int, help="paged KV cache blocks")
    p.add_argument("--cb-max-batch-tokens", type=int, help="tokens per continuous-batching step")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log", help="server log file (default: a temp file)")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # Ctrl-C and SIGTERM both take the clean path below, also when this was started with SIGINT ignored
    # (a shell's background job inherits SIG_IGN, and Python then leaves SIGINT ignored).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    cfg = BaselineConfig(args.model, args.port, args.host, args.device, args.dtype, args.cb_num_blocks,
                         args.cb_max_batch_tokens)
    print("starting: " + " ".join(cfg.command()), flush=True)
    try:
        server = start_baseline(cfg, args.ready_timeout, args.log)
    except (RuntimeError, AssertionError) as e:
        print(f"kvmesh bench baseline: {e}", file=sys.stderr)
        return 1
    try:
        # Inside the try: a Ctrl-C that arrives right after this line (a test sends one on seeing it) must
        # take the clean path, not escape as KeyboardInterrupt and kill the process with SIGINT (exit -2).
        print(f"ready: --base-url {cfg.base_url} --model {cfg.model_name}  (log: {server.log_path}); Ctrl-C stops it",
              flush=True)
        while server.process.poll() is None:
            time.sleep(1.0)
        print(f"transformers serve exited with {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
