"""FP8 KV caches are indexed as bytes: gathering and writing blocks of a float8 cache moves exactly the bits the
same ops move in a full-precision cache, and no index op ever sees a float8 tensor (whether one has a float8
kernel depends on the torch version and device, so the engine never asks)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.decode_attention import gather_blocks as gather_cache_rows
from kernels.fp8_bytes import indexable
from kernels.store_kv import FP8_DTYPE, quantize_fp8, store_kv_ref
from shared.engine.kv_cache import gather_blocks, write_blocks

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 10, 4, 2, 8
INDEX_OPS = ("index_select", "index_copy", "index_put", "index_add", "take", "gather", "scatter")


class IndexDtypes(TorchDispatchMode):
    """Every index op that ran, with the dtypes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's hook
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if any(op in name for op in INDEX_OPS):
            dtypes = {a.dtype for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
            self.seen.append((name, dtypes))
        return func(*args, **kwargs)

    def float8_ops(self) -> list[str]:
        return [name for name, dtypes in self.seen if any(d.itemsize == 1 and d.is_floating_point for d in dtypes)]


def _caches(seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same KV as an FP8 cache and as a float32 cache (float32 holding the FP8 values exactly)."""
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    fp8 = [tuple(quantize_fp8(torch.randn(shape, generator=g) * 3, 1.0) for _ in range(2)) for _ in range(LAYERS)]
    f32 = [(k.float(), v.float()) for k, v in fp8]
    return fp8, f32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(FP8_DTYPE).view(torch.uint8)


def test_indexable_is_a_byte_view_of_one_byte_floats_only():
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = torch.zeros(2, 3, dtype=dtype)
        view = indexable(t)
        assert view.dtype == torch.uint8 and view.shape == t.shape and view.data_ptr() == t.data_ptr()
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8):
        t = torch.zeros(2, 3, dtype=dtype)
        assert indexable(t) is t


def test_gathered_fp8_blocks_are_the_full_precision_path_bit_for_bit():
    fp8, f32 = _caches(1)
    ids = [7, 0, 3, 3, 9]
    with IndexDtypes() as ops:
        k8, v8 = gather_blocks(fp8, ids)
    k32, v32 = gather_blocks(f32, ids)
    assert k8.dtype == FP8_DTYPE and k8.shape == k32.shape == (LAYERS, len(ids), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert torch.equal(k8.view(torch.uint8), _bytes(k32)) and torch.equal(v8.view(torch.uint8), _bytes(v32))
    assert ops.seen and not ops.float8_ops(), ops.seen


def test_written_fp8_blocks_are_the_full_precision_path_bit_for_bit():
    fp8, f32 = _caches(2)
    src8, _ = _caches(3)
    k8 = torch.stack([k[:2] for k, _ in src8[1:]])  # two blocks of layers 1 and 2
    v8 = torch.stack([v[:2] for _, v in src8[1:]])
    ids = [5, 1]
    with IndexDtypes() as ops:
        write_blocks(fp8, ids, k8, v8, first_layer=1)
    write_blocks(f32, ids, k8.float(), v8.float(), first_layer=1)
    for (k, v), (k32, v32) in zip(fp8, f32):
        assert torch.equal(k.view(torch.uint8), _bytes(k32)) and torch.equal(v.view(torch.uint8), _bytes(v32))
    assert torch.equal(fp8[1][0][5].view(torch.uint8), k8[0, 0].view(torch.uint8)), "block 5 of layer 1 written"
    assert ops.seen and not ops.float8_ops(), ops.seen


def test_the_attention_twins_gather_and_store_fp8_as_bytes():
    fp8, f32 = _caches(4)
    table = torch.tensor([2, 8, 2, 0], dtype=torch.int32)
    with IndexDtypes() as ops:
        rows8 = gather_cache_rows(fp8[0][0], table)
    rows32 = gather_cache_rows(f32[0][0], table)
    assert rows8.dtype == FP8_DTYPE and torch.equal(rows8.view(torch.uint8), _bytes(rows32))
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    slots = torch.tensor([5, -1, 33])
    with IndexDtypes() as store_ops:
        store_kv_ref(k, v, fp8[0][0], fp8[0][1], slots, 0.5, 2.0)
    store_kv_ref(quantize_fp8(k, 0.5).float(), quantize_fp8(v, 2.0).float(), f32[0][0], f32[0][1], slots)
    assert torch.equal(fp8[0][0].view(torch.uint8), _bytes(f32[0][0]))
    assert torch.equal(fp8[0][1].view(torch.uint8), _bytes(f32[0][1]))
    assert ops.seen and store_ops.seen and not ops.float8_ops() and not store_ops.float8_ops()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_precision_caches_index_in_their_own_dtype(dtype):
    _, f32 = _caches(6)
    caches = [(k.to(dtype), v.to(dtype)) for k, v in f32]
    k, v = gather_blocks(caches, [4, 2])
    assert k.dtype == dtype and torch.equal(k[0], caches[0][0][[4, 2]]) and torch.equal(v[2], caches[2][1][[4, 2]])
