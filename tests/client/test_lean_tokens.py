"""The keeper's lean reading of a store counts its token ids as the full one does.

The report-mode rule compares a parent-less store's token count with its
chain's blocks, so a count read from the encoded array's header has to agree
with the decoded list at every msgpack array width, and read as no tokens
whatever else the field holds."""

from __future__ import annotations

import msgspec
import pytest

from bridge.contract import BlockStored, GroupMessage
from bridge.residency.lean import LeanStored, residency_decoder, token_count
from tests.client.builders import hi, msg, stored


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536, 70000])
def test_the_header_count_is_the_list_length_at_every_array_width(n: int) -> None:
    event = stored([hi(0)])
    event.token_ids = list(range(n))
    payload = msgspec.msgpack.encode(msg([event]))
    full = msgspec.msgpack.decode(payload, type=GroupMessage).events[0]
    lean = residency_decoder().decode(payload).events[0]
    assert type(full) is BlockStored and type(lean) is LeanStored
    assert token_count(lean) == token_count(full) == n


@pytest.mark.parametrize("raw", [b"", b"\xc0", b"\x81\xa1a\x01", b"\xa3abc", b"\x05", b"\xdc\x00"])
def test_a_field_that_is_not_a_whole_array_counts_no_tokens(raw: bytes) -> None:
    assert token_count(LeanStored(block_hashes=[hi(0)], token_ids=msgspec.Raw(raw))) == 0
