"""A request's own chat template, rendered in a separate process with CPU time, memory and output limits.

Jinja's sandbox stops a template from reaching Python's internals, not from spending: `'a' * 10**10`, or
range(100000) loops nested three deep, are one short template each. Rendered in the tokenizer service's own
process (a thread that cannot be interrupted) it would hold a core and the memory until it finished. Here it
runs in a child process that loaded the same tokenizer: its address space is capped (MemoryError inside the
render), its CPU time per render is capped (the kernel's SIGXCPU ends it), the ids it sends back are capped,
and the parent kills it when a render takes longer than the wall-clock limit. A killed child is started again
for the next request. The checkpoint's own template, which the operator chose, is rendered in-process as before.

The pipe carries one JSON line each way (no pickle on any wire): the request's fields in, {"ids": [...]} or
{"error": "..."} out. Run as `python -m services.tokenizer.template_sandbox MODEL_DIR MAX_IDS`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # one render, as the parent waits for it (the child is killed past it)
    cpu_s: float = 5.0  # CPU seconds of one render (SIGXCPU)
    memory_bytes: int = 1 << 30  # address space the child may add to what loading the tokenizer took
    max_ids: int = 1 << 20  # token ids one render may produce
    start_s: float = 60.0  # loading the tokenizer in a fresh child


class TemplateRefused(Exception):
    """The render failed or passed a limit: the request's 400."""


class TemplateSandbox:
    """One child process, one render at a time; started on first use, started again after a kill."""

    def __init__(self, model_dir: str, limits: SandboxLimits = SandboxLimits()) -> None:
        self.model_dir = model_dir
        self.limits = limits
        self.kills = 0  # children killed for passing a limit (tests read it)
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def encode(self, request: dict[str, object]) -> list[int]:
        """Token ids of a chat rendered with request["chat_template"]; TemplateRefused naming the limit."""
        line = json.dumps(request, ensure_ascii=False).encode() + b"\n"
        async with self._lock:
            proc = await self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
                raw = await asyncio.wait_for(proc.stdout.readline(), self.limits.wall_s)
            except asyncio.TimeoutError:
                await self._kill()
                raise TemplateRefused(f"the chat template took longer than {self.limits.wall_s:g} s to render") from None
            except (ConnectionError, asyncio.LimitOverrunError, ValueError):
                await self._kill()
                raise TemplateRefused("the chat template's output is too large") from None
            if not raw:  # the child died: SIGXCPU past its CPU time, or killed by the kernel
                await self._kill()
                raise TemplateRefused(f"the chat template used more than {self.limits.cpu_s:g} s of CPU time or "
                                      f"more than {self.limits.memory_bytes >> 20} MiB of memory")
        answer = json.loads(raw)
        if "error" in answer:
            raise TemplateRefused(str(answer["error"]))
        return [int(i) for i in answer["ids"]]

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.tokenizer.template_sandbox", self.model_dir, str(self.limits.max_ids),
            str(self.limits.cpu_s), str(self.limits.memory_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=_child_env(),
            limit=16 * self.limits.max_ids + (1 << 16))  # a line of max_ids ids, each up to ~15 bytes
        assert self._proc.stdout is not None
        try:
            ready = await asyncio.wait_for(self._proc.stdout.readline(), self.limits.start_s)
        except asyncio.TimeoutError:
            ready = b""
        if ready.strip() != b"ready":
            await self._kill()
            raise TemplateRefused("the chat template sandbox did not start")
        return self._proc

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.kills += 1
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

    async def close(self) -> None:
        if self._proc is not None:
            self.kills -= 1  # a close is no kill for a limit
            await self._kill()


def _child_env() -> dict[str, str]:
    """The tokenizer's environment without the mesh's credentials and secrets (NATS_*, KVMESH_*): the child runs
    code a client wrote, inside Jinja's sandbox, and needs none of them."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "KVMESH_"))}


# ---------------------------------------------------------------------------------------------- the child


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _render(tokenizer, req: dict, max_ids: int) -> dict:  # noqa: ANN001
    from shared.models.template_args import template_variables
    from shared.models.tokenizer import encode_chat

    kwargs = dict(req.get("kwargs") or {})
    passthrough = {k: kwargs.pop(k) for k in ("continue_final_message", "documents") if k in kwargs}
    template = str(req["chat_template"])
    kwargs = {**template_variables(template, kwargs), **passthrough}
    ids = encode_chat(tokenizer, req["messages"], bool(req.get("add_generation_prompt", True)), req.get("tools"),
                      kwargs, chat_template=template, add_special_tokens=bool(req.get("add_special_tokens")))
    if len(ids) > max_ids:
        return {"error": f"the chat template rendered {len(ids)} tokens, more than {max_ids}"}
    return {"ids": ids}


def main(argv: list[str]) -> int:
    model_dir, max_ids, cpu_s, memory = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    from shared.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.encode("warm up")  # loaded and its threads started before the address space is capped
    limit = _address_space() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = used.ru_utime + used.ru_stime
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(spent + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            answer = _render(tokenizer, json.loads(line), max_ids)
        except MemoryError:
            answer = {"error": "the chat template needed more memory than a render may use"}
        except Exception as e:  # noqa: BLE001 - any failure of the render is the request's error
            answer = {"error": f"chat template: {str(e)[:500]}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
