"""How a transfer is cut into chunks: by blocks of all layers when one fits, else by layers of one block."""
from __future__ import annotations

HEADROOM = 16 * 1024  # msgpack framing and headers on top of the tensor bytes of a NATS message


def plan_chunks(num_layers: int, num_blocks: int, bytes_per_block_layer: int, max_bytes: int,
                headroom: int = HEADROOM) -> list[tuple[int, int, int, int]]:
    """(layer_start, layer_end, block_start, block_end) ranges whose K+V fit in max_bytes."""
    budget = max(max_bytes - headroom, bytes_per_block_layer)
    per_block_all_layers = num_layers * bytes_per_block_layer
    if per_block_all_layers <= budget:
        step = budget // per_block_all_layers
        return [(0, num_layers, b, min(b + step, num_blocks)) for b in range(0, num_blocks, step)]
    layers = max(1, budget // bytes_per_block_layer)
    return [(l0, min(l0 + layers, num_layers), b, b + 1) for b in range(num_blocks) for l0 in range(0, num_layers, layers)]
