"""What rank 0 tells the follower ranks: one fixed-size int64 header (the op and its integers), broadcast on
the control group, then, for the ops that carry one, an int32 payload broadcast on the compute group. No pickle:
two tensors of known dtype and a layout both sides read from this one module."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

HEADER_LEN = 48
MAX_ARGS = HEADER_LEN - 2


class Op(IntEnum):
    STOP = 1  # leave the loop and exit 0
    ALLOCATE = 2  # args: num_blocks, dtype code: allocate the KV cache shard
    STEP = 3  # args: StepLayout; payload: the step's packed int32 buffer
    LOGITS = 4  # args: start, end: the output head over rows [start, end) of the last step's hidden rows
    GATHER = 5  # payload: block ids: send this rank's heads of those blocks to rank 0
    WRITE = 6  # args: first_layer, num_layers; payload: block ids: receive this rank's heads and write them
    # Rank-to-rank KV (shared/engine/tp/shard_link.py): each rank's head shard on the data plane, not via rank 0.
    LISTEN = 7  # payload: strings [host]: open this rank's KV receiver there; ports gathered to rank 0
    EXPECT = 8  # args: n_ids, first_block, deadline_ms; payload: block ids + strings [transfer id, token]
    FORGET = 9  # payload: strings [transfer id]: refuse the transfer's later frames (before its blocks are reused);
    #             a sender's: drop the state of a transfer abandoned before its last piece
    PROFILE_KV = 11  # args: num_blocks, dtype code, on: swap a temporary KV cache in (1) or the real one back (0)
    MEMORY = 12  # gather this rank's memory profile (RankMemory.report) to rank 0, on the control group
    GRAPHS = 13  # args: max_model_len, max_num_seqs, capture: build (and capture, in step with rank 0) decode graphs
    GRAPH_STEP = 14  # args: bs, n, width; payload: the staged rows [4, bs] then tables [bs, width]: replay bucket bs
    SEND_SHARDS = 10  # args: n_ids, first_block, final, deadline_ms; payload: block ids + strings
    #                   [transfer id, token, endpoint of rank 1, ...]: send this rank's heads; status all-reduced


# The KV cache dtypes a follower can be told to allocate, by code (torch dtypes have no stable integer).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@dataclass(frozen=True)
class Header:
    op: Op
    payload_len: int = 0  # int32 elements of the payload that follows (0: none)
    args: tuple[int, ...] = ()

    def encode(self) -> torch.Tensor:
        assert len(self.args) <= MAX_ARGS, f"{len(self.args)} header args, at most {MAX_ARGS}"
        t = torch.zeros(HEADER_LEN, dtype=torch.int64)
        t[0], t[1] = int(self.op), self.payload_len
        if self.args:
            t[2 : 2 + len(self.args)] = torch.tensor(self.args, dtype=torch.int64)
        return t

    @staticmethod
    def decode(t: torch.Tensor) -> Header:
        values = t.tolist()
        return Header(Op(values[0]), values[1], tuple(values[2:]))


# A step's payload is the driver's packed buffer (shared/engine/model_runner.StepBuffers): these views of it,
# in this order, each (offset, rows, cols) with cols -1 for a 1-D view.
STEP_VIEWS = ("ids", "positions", "slot_mapping", "prefill_query_start", "prefill_context_lens",
              "decode_context_lens", "rows", "prefill_block_tables", "decode_block_tables")


@dataclass(frozen=True)
class StepLayout:
    num_prefill_tokens: int
    max_prefill_query_len: int
    num_sample_rows: int
    num_hidden_rows: int
    views: tuple[tuple[int, int, int], ...]  # per STEP_VIEWS entry: (offset, rows, cols)

    def args(self) -> tuple[int, ...]:
        flat = [x for v in self.views for x in v]
        return (self.num_prefill_tokens, self.max_prefill_query_len, self.num_sample_rows, self.num_hidden_rows,
                *flat)

    @staticmethod
    def from_args(args: tuple[int, ...]) -> StepLayout:
        n = len(STEP_VIEWS)
        views = tuple(tuple(args[4 + 3 * i : 7 + 3 * i]) for i in range(n))
        return StepLayout(args[0], args[1], args[2], args[3], views)  # type: ignore[arg-type]

    @staticmethod
    def of(buffer: torch.Tensor, views: list[torch.Tensor], num_prefill_tokens: int, max_prefill_query_len: int,
           num_sample_rows: int, num_hidden_rows: int) -> StepLayout:
        """The layout of `views`, each a view into `buffer` (1-D int32)."""
        base = buffer.storage_offset()
        out = []
        for v in views:
            assert v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), "a view of another buffer"
            out.append((v.storage_offset() - base, v.shape[0], v.shape[1] if v.dim() == 2 else -1))
        return StepLayout(num_prefill_tokens, max_prefill_query_len, num_sample_rows, num_hidden_rows, tuple(out))

    @property
    def payload_len(self) -> int:
        return max(off + rows * (cols if cols >= 0 else 1) for off, rows, cols in self.views)

    def unpack(self, payload: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, (off, rows, cols) in zip(STEP_VIEWS, self.views):
            out[name] = (payload[off : off + rows] if cols < 0
                         else payload[off : off + rows * cols].view(rows, cols))
        return out


def pack_strings(items: list[str | bytes]) -> torch.Tensor:
    """Strings and byte strings as int32 words for a payload: per item its byte length, then its bytes padded to
    a multiple of 4 (a byte string travels as bytes; the reader knows which items are text)."""
    words: list[torch.Tensor] = []
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        padded = raw + bytes(-len(raw) % 4)
        words.append(torch.tensor([len(raw)], dtype=torch.int32))
        if padded:
            words.append(torch.frombuffer(bytearray(padded), dtype=torch.int32))
    return torch.cat(words) if words else torch.empty(0, dtype=torch.int32)


def unpack_strings(words: torch.Tensor) -> list[bytes]:
    """pack_strings' items back, as bytes."""
    raw = words.cpu().contiguous().numpy().tobytes()
    out, at = [], 0
    while at < len(raw):
        n = int.from_bytes(raw[at : at + 4], "little", signed=True)
        out.append(raw[at + 4 : at + 4 + n])
        at += 4 + n + (-n % 4)
    return out
