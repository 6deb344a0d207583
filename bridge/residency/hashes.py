"""Block hashes as a consumer meets them: raw bytes or vLLM's 64-bit ints.

vLLM's int form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its default in 0.33)
is the bytes hash read big-endian and cut to its low 64 bits. A request's chain
computed as bytes therefore also names the blocks of a worker that publishes
ints; the reverse is impossible, so a query given ints matches only ints.
"""

from __future__ import annotations

from bridge.contract import BlockHash

_LOW64 = (1 << 64) - 1


def as_int(value: BlockHash) -> int:
    """vLLM's int form of a hash (ints pass through, cut to 64 bits)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & _LOW64


def lookup_keys(value: BlockHash) -> tuple[BlockHash, ...]:
    """The keys a hash may be stored under in an index fed by either form."""
    if isinstance(value, bytes):
        return (value, as_int(value))
    return (value,)
