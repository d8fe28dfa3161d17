from shared.kv_transport.base import KVTransport, TransferError
from shared.kv_transport.mesh_transport import MeshKVTransport
from shared.kv_transport.nats_transport import NatsKVTransport

__all__ = ["KVTransport", "MeshKVTransport", "NatsKVTransport", "TransferError"]
