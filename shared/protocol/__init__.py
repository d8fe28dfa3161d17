"""One small message module per service boundary. Importing this package registers every kind."""
from shared.protocol.errors import ErrorReply
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from shared.protocol.generate import CancelRequest, GenerateRequest, ReplayRequest, TokenChunk, TokenLogprob
from shared.protocol.kvstore import (
    ContainsReply,
    ContainsRequest,
    GetReply,
    GetRequest,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
    StoredBlock,
)
from shared.protocol.kvtransfer import KVBlockChunk, KVChunkAck
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest
from shared.protocol.suffix import SharedOutput, SuffixOutputs
from shared.protocol.tokenizer import ChatMessage, DecodeReply, DecodeRequest, EncodeReply, EncodeRequest

__all__ = [
    "BlockRemoved", "BlockStored", "CancelRequest", "ChatMessage", "ContainsReply", "ContainsRequest",
    "DecodeReply", "DecodeRequest", "EncodeReply", "EncodeRequest", "ErrorReply", "GenerateRequest",
    "GetReply", "GetRequest", "KVBlockChunk", "KVChunkAck", "LoadBeat", "PutReply", "PutRequest",
    "RemotePrefillReply", "RemotePrefillRequest", "ReplayRequest", "SharedOutput", "StatsReply", "StatsRequest",
    "StoredBlock", "SuffixOutputs", "TokenChunk", "TokenLogprob",
]  # fmt: skip
