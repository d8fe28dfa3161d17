"""Which Triton kernel variants the project launches, and whether each compiles for real GPUs.

Recording: `LaunchRecorder` replaces every Triton kernel of the kernels/ modules by a stand-in whose
`kernel[grid](...)` launch is not run but bound exactly as Triton's own launcher binds it (the JIT
function's binder: argument types, integer and pointer specialisation such as divisibility by 16 or a
value of 1, constexprs). Each distinct binding is a `Variant`, the unit Triton compiles and caches at
run time. While recording, the dispatch functions on CPU call their Triton wrapper first (whose launches
are recorded) and then the torch twin, so the model's outputs stay right and an engine can serve real
steps under the recorder (kernels/triton_support.py).

Compiling: `compile_variants` compiles variants ahead of time for sm_80 / sm_90 / sm_100 with the ptxas
inside the triton wheel (no GPU needed) in a child process without TRITON_INTERPRET (the interpreter
replaces the JIT functions), and reads registers, shared memory and local (spill) bytes with cuobjdump.
Everything a variant carries is JSON (path tuples become lists), so nothing is pickled.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from kernels import triton_support
from kernels.triton_support import triton

# Per-block shared memory a kernel may use (the opt-in maximum of each architecture, bytes).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
# float8_e4m3 ("fp8e4nv") needs sm_89 or newer; the config refuses FP8 KV below it.
FP8_MIN_ARCH = 89


@dataclass(frozen=True)
class Variant:
    module: str  # e.g. "kernels.decode_attention"
    kernel: str  # the JIT function's name in that module
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]  # (argument path, value)
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, Any], ...]], ...]  # (argument path, attributes)
    options: tuple[tuple[str, Any], ...] = ()  # launch options given at the call (num_warps, ...)

    @property
    def fp8(self) -> bool:
        """Reads or writes an FP8 (e4m3) cache: a pointer typed fp8e4nv."""
        return any("fp8" in t for _, t in self.signature)

    def label(self) -> str:
        names = [n for n, _ in self.signature]
        ce = ",".join(f"{names[p[0]]}={v}" for p, v in self.constexprs)
        ptr = next((t for _, t in self.signature if t.startswith("*")), "")
        return f"{self.kernel}[{ptr[1:]}]({ce})"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Variant":
        return Variant(d["module"], d["kernel"], tuple(tuple(x) for x in d["signature"]),
                       tuple((tuple(p), v) for p, v in d["constexprs"]),
                       tuple((tuple(p), tuple(tuple(a) for a in attrs)) for p, attrs in d["attrs"]),
                       tuple(tuple(o) for o in d["options"]))


@dataclass
class VariantReport:
    variant: Variant
    arch: int
    ok: bool
    error: str = ""
    registers: int = 0
    shared_bytes: int = 0  # Triton's dynamic shared memory plus any static
    local_bytes: int = 0  # spills (and stack) in local memory
    num_warps: int = 0

    @property
    def shared_ok(self) -> bool:
        return self.shared_bytes <= SHARED_LIMIT[self.arch]


def _kernel_modules() -> list[str]:
    import kernels

    return [f"kernels.{m.name}" for m in pkgutil.iter_modules(kernels.__path__) if m.name not in ("aot",)]


def _is_kernel(obj: Any) -> bool:
    if triton is None:
        return False
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = JITFunction
    return isinstance(obj, (JITFunction, InterpretedFunction))


def _jit(obj: Any):
    """The JITFunction behind a kernel (under the interpreter, a fresh one around the same Python function)."""
    from triton.runtime.jit import JITFunction

    if isinstance(obj, JITFunction):
        return obj
    # The decorator's arguments (do_not_specialize, ...) change the binding: keep them.
    keep = ("do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")
    return JITFunction(obj.fn, **{k: v for k, v in getattr(obj, "kwargs", {}).items() if k in keep})


class _StandIn:
    def __init__(self, recorder: "LaunchRecorder", module: str, name: str, kernel: Any) -> None:
        self.recorder, self.module, self.name = recorder, module, name
        self.jit = _jit(kernel)
        self.binder = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.recorder.record(self, grid, args, kwargs)


@dataclass
class LaunchRecorder:
    """Context manager: every Triton launch of kernels/ inside it is bound and recorded, never run."""
    arch: int = 90  # the target whose backend binds the arguments (binding does not depend on it)
    variants: dict[Variant, int] = field(default_factory=dict)  # variant -> launches seen
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list)

    def __enter__(self) -> "LaunchRecorder":
        assert triton is not None, "triton is not installed"
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", self.arch, 32))
        for name in _kernel_modules():
            mod = importlib.import_module(name)
            for attr, obj in list(vars(mod).items()):
                if _is_kernel(obj):
                    self._saved.append((mod, attr, obj))
                    setattr(mod, attr, _StandIn(self, name, attr, obj))
        triton_support.set_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        triton_support.set_recorder(None)
        for mod, attr, obj in self._saved:
            setattr(mod, attr, obj)
        self._saved.clear()

    def record(self, stand_in: _StandIn, grid, args: tuple, kwargs: dict) -> None:
        from triton.runtime.jit import create_function_from_signature

        jit = stand_in.jit
        if stand_in.binder is None:
            stand_in.binder = create_function_from_signature(jit.signature, jit.params, self.backend)
        names = [p.name for p in jit.params]
        options = {k: v for k, v in kwargs.items() if k not in names}
        bound, spec, _ = stand_in.binder(*args, **kwargs)
        _, signature, constexprs, attrs = jit._pack_args(self.backend, dict(options), bound, spec, options)
        variant = Variant(
            stand_in.module, stand_in.name, tuple(signature.items()),
            tuple(sorted((tuple(p), v) for p, v in constexprs.items())),
            tuple(sorted((tuple(p), tuple(tuple(a) for a in a_list)) for p, a_list in attrs.items() if a_list)),
            tuple(sorted(options.items())))
        self.variants[variant] = self.variants.get(variant, 0) + 1

    def kernels(self) -> set[str]:
        return {v.kernel for v in self.variants}


# --- compiling --------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _resource_usage(cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, static shared, local, stack) bytes of the cubin's one function, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = {}
    for line in out.splitlines():
        if "REG:" in line:
            for item in line.split():
                key, _, value = item.partition(":")
                if value.isdigit():
                    fields[key] = int(value)
    return fields.get("REG", 0), fields.get("SHARED", 0), fields.get("LOCAL", 0), fields.get("STACK", 0)


def compile_one(variant_json: dict, arch: int) -> dict:
    """Compile one variant for sm_<arch>; a JSON report. Runs in the child process (no interpreter)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    v = Variant.from_json(variant_json)
    report = VariantReport(v, arch, ok=False)
    try:
        kernel = _jit(getattr(importlib.import_module(v.module), v.kernel))
        src = ASTSource(kernel, dict(v.signature), dict(v.constexprs),
                        {p: [list(a) for a in attrs] for p, attrs in v.attrs})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(v.options))
        regs, static_shared, local, stack = _resource_usage(compiled.asm["cubin"])
        report.ok = True
        report.registers = regs
        report.shared_bytes = compiled.metadata.shared + static_shared
        report.local_bytes = local + stack
        report.num_warps = compiled.metadata.num_warps
    except Exception as e:  # noqa: BLE001 - the report carries the compiler's message
        report.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]
    d = asdict(report)
    d["variant"] = variant_json
    return d


def _compile_job(job: tuple[dict, int]) -> dict:
    return compile_one(*job)


def compile_variants(variants: list[Variant], archs: list[int], workers: int | None = None,
                     timeout: float = 600) -> list[VariantReport]:
    """Compile every (variant, arch) in a child process (a pool of `workers`); reports in job order."""
    jobs = [[v.to_json(), a] for v in variants for a in archs]
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    payload = json.dumps({"jobs": jobs, "workers": workers or min(4, os.cpu_count() or 1)})
    proc = subprocess.run([sys.executable, "-m", "kernels.aot"], input=payload, capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile process failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = []
    for d in json.loads(proc.stdout):
        variant = Variant.from_json(d.pop("variant"))
        out.append(VariantReport(variant=variant, **d))
    return out


def _main() -> None:
    from concurrent.futures import ProcessPoolExecutor

    request = json.loads(sys.stdin.read())
    jobs = [tuple(j) for j in request["jobs"]]
    if request["workers"] > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(request["workers"]) as pool:
            reports = list(pool.map(_compile_job, jobs))
    else:
        reports = [_compile_job(j) for j in jobs]
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    _main()
