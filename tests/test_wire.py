"""The msgpack codec: every message round-trips; everything else is a WireError."""
from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from shared import protocol as p
from shared import wire
from shared.protocol.kvtransfer import checksum
from shared.sampling_params import SamplingParams, StructuredOutput
from shared.wire import Message, WireError, decode, encode, stacked_from_wire, tensor_from_wire, tensor_to_wire


def _tensor(*shape: int, dtype: torch.dtype = torch.float32) -> wire.WireTensor:
    return tensor_to_wire(torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(dtype))


def _kv_chunk() -> p.KVBlockChunk:
    tensors = [_tensor(2, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    return p.KVBlockChunk(
        transfer_id="t1", seq=0, total=1, layer_start=0, layer_end=2, block_start=3, block_end=5,
        tensors=tensors, checksum=checksum(tensors),
    )  # fmt: skip


def _block(h: bytes) -> p.StoredBlock:
    return p.StoredBlock(hash=h, parent=None, k=_tensor(2, 4, 1, 4), v=_tensor(2, 4, 1, 4))


from shared.protocol.lora import LoRAUpdate, LoRAUpdateReply  # noqa: E402
from shared.protocol.pooling import PoolReply, PoolRequest  # noqa: E402

SAMPLES: list[Message] = [
    p.ErrorReply(code="bad_request", message="nope"),
    p.EncodeRequest(prompt="héllo"),
    p.EncodeRequest(token_ids=[1, 2, 3], add_special_tokens=False),
    p.EncodeRequest(messages=[p.ChatMessage(role="user", content="hi")], add_generation_prompt=True),
    p.EncodeReply(token_ids=list(range(1000))),
    p.DecodeRequest(sequences=[[1, 2], [], [3]]),
    p.DecodeReply(texts=["a", "", "ü"]),
    p.GenerateRequest(
        request_id="r1", prompt_token_ids=[5, 6, 7], priority=2, reply_subject="_INBOX.x",
        sampling=SamplingParams(max_tokens=8, temperature=0.7, top_k=40, seed=1234, stop_token_ids=[2], logprobs=3),
    ),  # fmt: skip
    p.TokenChunk(
        request_id="r1", seq=0, token_ids=[9],
        logprobs=[p.TokenLogprob(token_id=9, logprob=-0.5, top_ids=[9, 1], top_logprobs=[-0.5, -1.5])],
        num_cached_tokens=16,
    ),  # fmt: skip
    p.TokenChunk(request_id="r1", seq=7, finish_reason="error", error="boom"),
    p.CancelRequest(request_id="r1", reason="client disconnected"),
    p.ReplayRequest(request_id="r1-m1", from_seq=17),
    p.RemotePrefillRequest(
        request_id="r1", transfer_id="t1", prompt_token_ids=list(range(40)), num_cached_tokens=16,
        decode_worker_id="d0", num_dest_blocks=2, block_size=16,
    ),  # fmt: skip
    p.RemotePrefillReply(request_id="r1", transfer_id="t1", first_token_id=3, logprobs=p.TokenLogprob(token_id=3, logprob=-0.1)),
    _kv_chunk(),
    p.KVChunkAck(transfer_id="t1", seq=0, ok=False, error="checksum mismatch on chunk 0"),
    p.PutRequest(blocks=[_block(b"\x01" * 16), _block(b"\x02" * 16)]),
    p.PutReply(num_stored=2),
    p.GetRequest(hashes=[b"\x01" * 16], max_blocks=4),
    p.GetReply(blocks=[_block(b"\x01" * 16)]),
    p.ContainsRequest(hashes=[b"\x01" * 16, b"\x02" * 16]),
    p.ContainsReply(num_prefix_blocks=1),
    p.StatsRequest(),
    p.StatsReply(cpu_blocks=1, cpu_bytes=2, disk_blocks=3, disk_bytes=4, hits=5, misses=6),
    p.BlockStored(worker_id="d0", hashes=[b"a" * 16, b"b" * 16], parent=b"z" * 16),
    p.BlockRemoved(worker_id="d0", hashes=[b"a" * 16]),
    p.LoadBeat(worker_id="d0", running=3, waiting=1, free_blocks=100, total_blocks=128),
    p.SuffixOutputs(worker_id="d0", model_tag=b"\x01" * 16,
                    outputs=[p.SharedOutput(salt_tag=b"\x02" * 16, token_ids=[1, 2, 3]), p.SharedOutput(token_ids=[4, 5])]),
    LoRAUpdate(action="load", lora_name="a", lora_path="/adapters/a"),
    LoRAUpdateReply(worker_id="d0", ok=False, error="rank 64 is above --max-lora-rank 16", adapters=["b"]),
    PoolRequest(request_id="r1", token_ids=[1, 2, 3], task="embed", dimensions=8),
    PoolReply(request_id="r1", data=b"\x00" * 8, rows=1, cols=2, num_tokens=3),
]


def _raw(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def test_every_kind_has_a_sample() -> None:
    assert {type(m).KIND for m in SAMPLES} == set(wire._registry())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).KIND)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg) and back == msg
    assert decode(data, type(msg)) == msg
    assert back.version == type(msg).VERSION


def test_tensor_round_trip_all_dtypes() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool):
        t = (torch.randn(3, 5) * 10).to(dtype)
        back = tensor_from_wire(tensor_to_wire(t))
        assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    empty = tensor_from_wire(tensor_to_wire(torch.zeros(0, 4, dtype=torch.bfloat16)))
    assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
    scalar = tensor_from_wire(tensor_to_wire(torch.tensor(2.5)))
    assert scalar.shape == () and scalar.item() == 2.5
    # non-contiguous input travels as its logical contents
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(tensor_from_wire(tensor_to_wire(t)), t)
    # the result is writable and does not alias the message
    w = tensor_to_wire(torch.ones(2))
    out = tensor_from_wire(w)
    out += 1
    assert tensor_from_wire(w).tolist() == [1.0, 1.0]


def test_stacked_from_wire_equals_torch_stack() -> None:
    """KV blocks fetched from the kvstore are stacked by numpy (one thread) into [layers, n, ...]."""
    kv = torch.randn(3, 4, 2, 5, 8).to(torch.bfloat16)  # [layers, blocks, block size, heads, head dim]
    parts = [tensor_to_wire(kv[:, i]) for i in range(4)]  # non-contiguous slices, as offload sends them
    assert torch.equal(stacked_from_wire(parts, 1), kv)
    assert torch.equal(stacked_from_wire(parts[:1], 0), kv[:, 0][None])
    with pytest.raises(WireError, match="differ"):
        stacked_from_wire([parts[0], tensor_to_wire(kv[:, 1].float())], 1)


def test_tensor_size_mismatch_rejected() -> None:
    with pytest.raises(WireError, match="needs 24 bytes"):
        tensor_from_wire({"dtype": "float32", "shape": [2, 3], "data": b"\0" * 20})
    with pytest.raises(WireError):
        tensor_from_wire({"dtype": "complex64", "shape": [1], "data": b"\0" * 8})
    # inside a message the decoder checks it too
    good = encode(p.GetReply(blocks=[_block(b"\x01")]))
    obj = msgpack.unpackb(good)
    obj["blocks"][0]["k"]["data"] = obj["blocks"][0]["k"]["data"][:-1]
    with pytest.raises(WireError, match="blocks.0.k"):
        decode(msgpack.packb(obj, use_bin_type=True))


def test_kv_chunk_checksum() -> None:
    chunk = _kv_chunk()
    assert decode(encode(chunk)).verify()
    tampered = chunk.model_copy(update={"checksum": chunk.checksum ^ 1})
    assert not tampered.verify()


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(p.ErrorReply(code="x", message="y")),
        pickle.dumps({"kind": "error", "version": 1, "code": "x", "message": "y"}, protocol=2),
        pickle.dumps({"kind": "error"}, protocol=0),
        b"",
        b"\xc1",  # never-used msgpack byte
        b"garbage that is not msgpack at all \xff\xfe",
        b"\x80",  # an empty map
        msgpack.packb([1, 2, 3]),
        msgpack.packb("error"),
    ],
    ids=["pickle-model", "pickle-dict", "pickle-proto0", "empty", "reserved-byte", "garbage", "empty-map", "array", "string"],
)
def test_garbage_rejected(data: bytes) -> None:
    with pytest.raises(WireError):
        decode(data)


def test_truncated_rejected() -> None:
    data = encode(SAMPLES[7])
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(WireError, match="not a kvmesh message"):
            decode(data[:cut])
    with pytest.raises(WireError, match="extra data"):
        decode(data + b"\x00")


def test_extension_types_rejected() -> None:
    with pytest.raises(WireError, match="extension type 5"):
        decode(_raw(kind="error", version=1, code="a", message="b", x=msgpack.ExtType(5, b"payload")))
    # The timestamp extension bypasses msgpack's ext_hook; it must still be refused, even nested.
    with pytest.raises(WireError, match="Timestamp"):
        decode(_raw(kind="error", version=1, code="a", message="b", x=[1, {"t": msgpack.Timestamp(5)}]))


def test_unknown_kind_and_missing_envelope() -> None:
    with pytest.raises(WireError, match="unknown message kind 'evil.kind'"):
        decode(_raw(kind="evil.kind", version=1))
    with pytest.raises(WireError, match="missing 'kind'"):
        decode(_raw(code="a", message="b"))
    with pytest.raises(WireError, match="bad version"):
        decode(_raw(kind="error", code="a", message="b"))
    with pytest.raises(WireError, match="bad version"):
        decode(_raw(kind="error", version="1", code="a", message="b"))


def test_newer_major_version_rejected() -> None:
    with pytest.raises(WireError, match="version 2 is newer"):
        decode(_raw(kind="error", version=2, code="a", message="b"))


def test_wrong_field_types_rejected() -> None:
    base = encode(SAMPLES[7])  # GenerateRequest
    cases = {
        "request_id": 123,
        "prompt_token_ids": ["1", "2"],
        "priority": 1.5,
        "sampling": {"temperature": "hot"},
        "reply_subject": b"bytes-not-str",
    }
    for key, value in cases.items():
        obj = msgpack.unpackb(base)
        obj[key] = value
        with pytest.raises(WireError, match=key):
            decode(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(WireError, match="hashes"):
        decode(_raw(kind="event.block_removed", version=1, worker_id="d0", hashes=["not-bytes"]))
    with pytest.raises(WireError, match="ignore_eos"):
        decode(_raw(kind="decode.generate", version=1, request_id="r", prompt_token_ids=[1], sampling={"ignore_eos": 1}))
    with pytest.raises(WireError, match="code"):
        decode(_raw(kind="error", version=1, message="missing code"))


def test_invalid_values_rejected() -> None:
    with pytest.raises(WireError, match="top_p"):
        decode(_raw(kind="decode.generate", version=1, request_id="r", prompt_token_ids=[1], sampling={"top_p": 0.0}))
    with pytest.raises(WireError, match="exactly one"):
        decode(_raw(kind="tokenizer.encode", version=1, prompt="a", token_ids=[1]))


def test_extra_fields_ignored_for_forward_compat() -> None:
    obj = msgpack.unpackb(encode(SAMPLES[0]))
    obj["added_in_a_later_minor"] = {"nested": [1, 2, b"x"]}
    assert decode(msgpack.packb(obj, use_bin_type=True)) == SAMPLES[0]


def test_expect_restricts_kind() -> None:
    data = encode(p.ErrorReply(code="a", message="b"))
    with pytest.raises(WireError, match="expected decode.token_chunk"):
        decode(data, p.TokenChunk)
    assert isinstance(decode(data, (p.TokenChunk, p.ErrorReply)), p.ErrorReply)


def test_sampling_params_cross_the_wire_as_they_are() -> None:
    """The engine's SamplingParams is the wire's: a round trip gives the same value, logit_bias keys stay
    ints (strings only inside the msgpack bytes), and invalid values are a WireError at decode."""
    sp = SamplingParams(max_tokens=5, temperature=0.0, top_k=-1, stop_token_ids=[3], logprobs=2,
                        logit_bias={7: -3.0, 1: 100.0}, structured=StructuredOutput(kind="regex", spec="a+"))
    req = p.GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=sp)
    back = decode(encode(req), p.GenerateRequest).sampling
    assert back == sp and back.top_k == 0
    assert all(type(k) is int for k in back.logit_bias)
    data = bytearray(encode(req.model_copy(update={"sampling": sp.model_copy(update={"max_tokens": 0})})))
    with pytest.raises(WireError, match="max_tokens"):
        decode(bytes(data), p.GenerateRequest)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(WireError):
        encode({"kind": "error"})  # type: ignore[arg-type]
