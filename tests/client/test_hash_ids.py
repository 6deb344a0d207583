"""The fleet's hash ids (`bridge.residency.hash_ids`) when a store lists a
hash more than once, as a snapshot's tier does for a hash with several
copies: each hash is named once, whatever else the store holds."""

from __future__ import annotations

from bridge.residency.hash_ids import HashIds


def _ids() -> HashIds:
    return HashIds(on_grow=lambda cap: None)


def test_a_store_that_lists_a_hash_again_names_it_once() -> None:
    ids = _ids()
    a, b = ids.intern([b"a", b"b"])
    got = ids.intern([b"c", b"a", b"c", b"d", b"d", 1, b"\x01", 1])
    c, d, one, one_bytes = got[0], got[3], got[5], got[6]
    assert got == [c, a, c, d, d, one, one_bytes, one]
    assert len({a, b, c, d, one, one_bytes}) == 6  # an int and bytes of the same value are two hashes
    assert [c, d, one, one_bytes] == list(range(c, c + 4))  # new ones in the order they first came
    assert [ids.hash_at(i) for i in (a, b, c, d, one, one_bytes)] == [b"a", b"b", b"c", b"d", 1, b"\x01"]
    assert len(ids) == 6 and ids.int_ids == 1 and ids.bytes_ids == 5
    assert ids.intern([b"d", b"c", b"d"]) == [d, c, d]


def test_a_store_that_lists_a_hash_again_takes_freed_ids_first() -> None:
    ids = _ids()
    a, b, c = ids.intern([b"a", b"b", b"c"])
    ids.forget(b)
    got = ids.intern([b"x", b"x", b"y", b"a"])
    assert got[0] == got[1] and got[3] == a
    assert {got[0], got[2]} == {b, c + 1}  # the freed id, then the next new one
    assert ids.hash_at(got[0]) == b"x" and ids.hash_at(got[2]) == b"y"
    assert ids.by_hash == {b"a": a, b"c": c, b"x": got[0], b"y": got[2]}
