"""Worker ranks as slots, and sets of slots as bitsets (Python ints).

The fleet structure names each worker rank by a small int, its slot, so a
set of ranks (the holders of a block, the candidates of a query) is one int
whose bit s stands for slot s: a union or an intersection over the whole
fleet is one C-level operation.
"""

from __future__ import annotations

from itertools import compress, count
from typing import NamedTuple

ALL = -1  # every bit
_BIN01 = bytes.maketrans(b"01", b"\x00\x01")


class WorkerKey(NamedTuple):
    worker: str
    dp_rank: int


def slots_of(bits: int) -> list[int]:
    """The slots of a bitset, any order."""
    if bits.bit_count() <= 16:
        out = []
        while bits:
            s = bits.bit_length() - 1
            out.append(s)
            bits ^= 1 << s
        return out
    return list(compress(count(), flags(bits)))


def flags(bits: int) -> bytes:
    """A bitset as one byte per slot (1 where set), up to its highest slot."""
    return bin(bits)[:1:-1].encode().translate(_BIN01)
