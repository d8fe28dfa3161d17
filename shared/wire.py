"""The wire codec: typed messages <-> msgpack bytes. Never pickle.

A message on the wire is one msgpack map: the model's fields plus two envelope keys, `kind`
(which message class) and `version` (that class's major schema version). Decoding trusts
nothing: extension types, trailing bytes, truncated input, unknown kinds, newer major versions
and fields of the wrong type all raise `WireError`. Extra fields of plain msgpack types are
ignored so a newer sender can add optional fields without breaking older readers; anything
incompatible bumps the class's VERSION.

Tensors travel as `{"dtype": str, "shape": [..], "data": bytes}` (raw little-endian bytes);
see `tensor_to_wire` / `tensor_from_wire`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

if TYPE_CHECKING:  # torch is heavy; services that never touch tensors should not import it
    import torch

KIND_KEY = "kind"
VERSION_KEY = "version"
_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})

M = TypeVar("M", bound="Message")


class WireError(ValueError):
    """Bytes that are not a valid kvmesh message (or a message that cannot be encoded)."""


class WireModel(BaseModel):
    """A value carried inside messages. Strict: "1" is not an int, a str is not bytes."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class Message(WireModel):
    """A top-level message. Subclasses set KIND (unique) and bump VERSION on breaking changes."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    # Filled at class creation time, read-only afterwards: the decoder's kind -> class table.
    _registry: ClassVar[dict[str, type[Message]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls.KIND:
            return  # an abstract intermediate class
        assert KIND_KEY not in cls.model_fields and VERSION_KEY not in cls.model_fields, "reserved field name"
        assert cls.VERSION >= 1
        other = Message._registry.get(cls.KIND)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(f"message kind {cls.KIND!r} already used by {other.__qualname__}")
        Message._registry[cls.KIND] = cls

    @property
    def version(self) -> int:
        return self.VERSION


def encode(msg: Message) -> bytes:
    if not isinstance(msg, Message) or not msg.KIND:
        raise WireError(f"cannot encode {type(msg).__name__}: not a registered Message")
    body = msg.model_dump(mode="python")
    body[KIND_KEY] = msg.KIND
    body[VERSION_KEY] = msg.VERSION
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes | bytearray | memoryview, expect: type[M] | tuple[type[Message], ...] | None = None) -> M:
    """Decodes one message; `expect` restricts which classes are acceptable."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext)
    except WireError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ValueError, ExtraData, FormatError, ...)
        raise WireError(f"not a kvmesh message: {type(e).__name__}: {_short(e)}") from None
    _check_plain(obj)
    if not isinstance(obj, dict):
        raise WireError(f"not a kvmesh message: top level is {type(obj).__name__}, not a map")
    kind, version = obj.pop(KIND_KEY, None), obj.pop(VERSION_KEY, None)
    if not isinstance(kind, str):
        raise WireError("not a kvmesh message: missing 'kind'")
    cls = _registry().get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind!r}" + (f"; expected {_names(expect)}" if expect else ""))
    if expect is not None and not issubclass(cls, expect):
        raise WireError(f"unexpected message kind {kind!r}; expected {_names(expect)}")
    if type(version) is not int or version < 1:
        raise WireError(f"{kind}: bad version {version!r}")
    if version > cls.VERSION:
        raise WireError(f"{kind}: version {version} is newer than the supported major version {cls.VERSION}")
    try:
        return cls.model_validate(obj)  # type: ignore[return-value]
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:5])
        raise WireError(f"{kind}: invalid fields: {problems}") from None


def _registry() -> dict[str, type[Message]]:
    # Kinds register when their module is imported; a process knows the kinds of the modules it uses
    # (importing shared.protocol here made the wire depend on the layer above it).
    return Message._registry


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} is not allowed")


def _check_plain(obj: Any) -> None:
    """Rejects anything but plain msgpack values (the timestamp extension bypasses ext_hook)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        t = type(item)
        if t in _SCALARS:
            continue
        if t is dict:
            stack.extend(item.values())  # keys are str/bytes already (strict_map_key)
        elif t is list:
            if not set(map(type, item)) <= _SCALARS:  # fast path: token id lists
                stack.extend(item)
        else:
            raise WireError(f"msgpack type {t.__name__} is not allowed")


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 120 else text[:117] + "..."


def _names(expect: type | tuple[type, ...]) -> str:
    types = expect if isinstance(expect, tuple) else (expect,)
    return " or ".join(getattr(t, "KIND", "") or t.__name__ for t in types)


# --------------------------------------------------------------------------- tensors

DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


class WireTensor(WireModel):
    """Raw tensor bytes; the validator guarantees len(data) == numel * itemsize."""

    dtype: str
    shape: list[int]
    data: bytes

    @model_validator(mode="after")
    def _consistent(self) -> WireTensor:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"{self.dtype}{self.shape} needs {expected} bytes, got {len(self.data)}")
        return self

    @property
    def nbytes(self) -> int:
        return len(self.data)


def tensor_to_wire(t: torch.Tensor) -> WireTensor:
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise WireError(f"dtype {t.dtype} cannot travel on the wire")
    t = t.detach().to("cpu")
    # numpy makes the C-order copy, on one thread: this runs on event loops, and a torch copy of a KV block
    # would start an OpenMP team on the loop's thread, which slows the engine thread's every step down
    # (shared/engine/engine_thread.py). Viewed as a same-width integer: numpy has no bfloat16.
    same_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    data = t.view(same_width).numpy().tobytes() if t.numel() else b""
    return WireTensor(dtype=name, shape=list(t.shape), data=data)


def tensor_from_wire(w: WireTensor | dict[str, Any]) -> torch.Tensor:
    """A fresh, writable CPU tensor (the bytes are copied once)."""
    import torch

    if not isinstance(w, WireTensor):
        try:
            w = WireTensor.model_validate(w)
        except ValidationError as e:
            raise WireError(f"invalid tensor: {e.errors()[0]['msg']}") from None
    dtype = getattr(torch, w.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"dtype {w.dtype} is not available in this torch build")
    if not w.data:
        return torch.empty(w.shape, dtype=dtype)
    return torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).reshape(w.shape)


def stacked_from_wire(ws: list[WireTensor], dim: int) -> torch.Tensor:
    """torch.stack(map(tensor_from_wire, ws), dim), with the copy made by numpy on one thread (it runs on
    event loops: see tensor_to_wire). The tensors must agree in dtype and shape."""
    import numpy as np
    import torch

    first = ws[0]
    if any(w.dtype != first.dtype or w.shape != first.shape for w in ws):
        raise WireError("tensors to stack differ in dtype or shape")
    dtype = getattr(torch, first.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"dtype {first.dtype} is not available in this torch build")
    width = DTYPE_SIZES[first.dtype]
    if any(len(w.data) != math.prod(first.shape) * width for w in ws):
        raise WireError("tensor data does not match its shape")
    if not first.shape:
        raise WireError("cannot stack 0-d tensors")
    # Bytes keep the last dimension times the width; viewing the result as the dtype folds it back.
    parts = [np.frombuffer(w.data, dtype=np.uint8).reshape(*first.shape[:-1], first.shape[-1] * width) for w in ws]
    return torch.from_numpy(np.stack(parts, axis=dim)).view(dtype)
