"""The driver-to-followers channel: headers on a gloo control group on the CPU, whose timeout is long because a
follower waits there while the engine is idle (a dead peer still fails it at once: gloo sees the closed
connection); payloads and the model's collectives on the compute group (gloo on CPU, NCCL on CUDA), whose
timeout bounds a stuck collective."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shared.engine.tp.step_message import HEADER_LEN, Header


class TPChannel:
    def __init__(self, control_group: Any, compute_group: Any, device: str) -> None:
        self.control = control_group
        self.compute = compute_group
        self.device = device
        self._payload = torch.empty(0, dtype=torch.int32, device=device)  # followers' receive buffer

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """Rank 0: the header, then the payload (int32, on the device, header.payload_len elements)."""
        dist.broadcast(header.encode(), src=0, group=self.control)
        if header.payload_len:
            assert payload is not None and payload.numel() == header.payload_len and payload.dtype == torch.int32
            dist.broadcast(payload.contiguous(), src=0, group=self.compute)

    def receive(self) -> tuple[Header, torch.Tensor | None]:
        """Ranks 1..N-1: the next header and its payload (a view of a reused buffer, valid until the next call)."""
        t = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.control)
        header = Header.decode(t)
        if not header.payload_len:
            return header, None
        if self._payload.numel() < header.payload_len:
            self._payload = torch.empty(max(header.payload_len, 2 * self._payload.numel()), dtype=torch.int32,
                                        device=self.device)
        payload = self._payload[: header.payload_len]
        dist.broadcast(payload, src=0, group=self.compute)
        return header, payload
