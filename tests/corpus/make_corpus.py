"""Writes the malformed-input corpus: `python tests/corpus/make_corpus.py`.

The files are committed; this script documents how each was made and can
regenerate them. `manifest.json` says what each entry is and what the bridge
must do with it (tests/fuzz/test_corpus.py replays every entry).

- `frames/*.hex`: one multipart ZMQ message as the PUB socket would carry it,
  one frame per line in hex (`-` is an empty frame, `HH*N` is byte HH N times,
  `#` starts a comment).
  Sent raw, unnumbered; the frame checks must refuse each one.
- `payloads/*.bin`: one raw payload frame. Sent as a numbered batch (topic, a
  valid seq, this payload): the decoder must refuse it or keep its good events,
  and the normalizer refuse events that name no real group or exceed a batch's
  bound (`bad_group`, `too_many_messages`). A numbered batch with any refusal
  is named by a `malformed` gap.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).parent
enc = msgspec.msgpack.encode
MAX_FRAME = 65536  # the corpus test runs the bridge with --max-frame-bytes 65536

H = hashlib.sha256(b"corpus").digest()
GOOD = {"type": "BlockStored", "block_hashes": [H], "parent_block_hash": None, "token_ids": [1, 2, 3],
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention"}
GOOD_BATCH = enc([1796000000.5, [GOOD], 0])
SEQ = (7).to_bytes(8, "big")

FRAMES: dict[str, tuple[str, list[bytes], str]] = {
    # name: (what, frames, malformed reason)
    "one_frame": ("a single frame", [b"only-one-frame"], "frame_count"),
    "two_frames": ("topic and seq, no payload", [b"", SEQ], "frame_count"),
    "four_frames": ("a replay answer's shape on the PUB socket", [b"", b"", SEQ, GOOD_BATCH], "frame_count"),
    "six_frames": ("six empty frames", [b""] * 6, "frame_count"),
    "seq_empty": ("an empty seq frame", [b"", b"", GOOD_BATCH], "bad_seq"),
    "seq_short": ("a 2-byte seq", [b"", b"\x00\x07", GOOD_BATCH], "bad_seq"),
    "seq_seven": ("a 7-byte seq", [b"", b"\x00" * 7, GOOD_BATCH], "bad_seq"),
    "seq_long": ("a 9-byte seq", [b"", b"\x00" * 9, GOOD_BATCH], "bad_seq"),
    "seq_text": ("the seq written as text", [b"", b"7", GOOD_BATCH], "bad_seq"),
    "payload_oversize": ("a payload one byte over --max-frame-bytes", [b"", SEQ, b"\x00" * (MAX_FRAME + 1)], "too_large"),
    "topic_oversize": ("a 2 kB topic", [b"t" * 2048, SEQ, GOOD_BATCH], "bad_topic"),
}

_DEEP = 5000


def _deep_event(depth: int) -> bytes:
    return (b"\x83" + enc("type") + enc("BlockStored") + enc("block_hashes") + enc([H]) + enc("extra_keys")
            + b"\x91" * depth + b"\xc0")


PAYLOADS: dict[str, tuple[str, bytes, dict[str, int], int, str]] = {
    # name: (what, payload, malformed counts, good events kept, known bug or "")
    "empty": ("an empty payload", b"", {"bad_batch": 1}, 0, ""),
    "not_msgpack": ("0xc1, a byte msgpack never uses", b"\xc1 not msgpack", {"bad_batch": 1}, 0, ""),
    "map_not_array": ("the batch as a map", enc({"ts": 1.0, "events": [GOOD]}), {"bad_batch": 1}, 0, ""),
    "empty_array": ("[]", enc([]), {"bad_batch": 1}, 0, ""),
    "ts_only": ("[ts] without events", enc([1.0]), {"bad_batch": 1}, 0, ""),
    "ts_string": ("ts as a string", enc(["1.0", [GOOD]]), {"bad_batch": 1}, 0, ""),
    "events_not_list": ("events as a map", enc([1.0, {"0": GOOD}]), {"bad_batch": 1}, 0, ""),
    "dp_rank_string": ("data_parallel_rank as a string", enc([1.0, [GOOD], "0"]), {"bad_batch": 1}, 0, ""),
    "truncated": ("a good batch cut in half", GOOD_BATCH[: len(GOOD_BATCH) // 2], {"bad_batch": 1}, 0, ""),
    "trailing_garbage": ("a good batch with bytes after it", GOOD_BATCH + b"\x00\x01", {"bad_batch": 1}, 0, ""),
    "array32_huge_header": ("an array32 header claiming 4G elements", b"\xdd\xff\xff\xff\xff" + enc(1.0),
                            {"bad_batch": 1}, 0, ""),
    "bin32_huge_header": ("a bin32 hash claiming 4 GB",
                          b"\x92" + enc(1.0) + b"\x91\x82" + enc("type") + enc("BlockStored") + enc("block_hashes")
                          + b"\x91\xc6\xff\xff\xff\xff", {"bad_batch": 1}, 0, ""),
    "unknown_event_type": ("a good event and one of a type vLLM may add later",
                           enc([1.0, [GOOD, {"type": "BlockPromoted", "block_hashes": [H]}]]),
                           {"unknown_event_type": 1}, 1, ""),
    "bad_events": ("a good event among four broken ones",
                   enc([1.0, [{"type": "BlockStored", "block_hashes": "not-a-list"}, 42, GOOD, "text",
                              {"block_hashes": [H]}]]), {"bad_event": 4}, 1, ""),
    "wrong_field_types": ("block_size as text, group_idx as float, medium as bytes",
                          enc([1.0, [{**GOOD, "block_size": "16"}, {**GOOD, "group_idx": 1.5},
                                     {**GOOD, "medium": b"GPU"}, GOOD]]), {"bad_event": 3}, 1, ""),
    "invalid_utf8": ("a medium string that is not UTF-8",
                     enc([1.0, [GOOD]]).replace(b"\xa3GPU", b"\xa3\xff\xfe\xfd"), {"bad_event": 1}, 0, ""),
    "unknown_keys_and_fields": ("unknown event keys, extra batch elements: a newer vLLM",
                                enc([1.0, [{**GOOD, "brand_new": {"a": [1, {"b": None}]}, "x": b"\x00"}], 0,
                                     "extra", {"more": 1}]), {}, 1, ""),
    "extreme_ints": ("int hashes at the int64/uint64 limits, huge block_size, the largest group_idx",
                     enc([1.0, [{**GOOD, "block_hashes": [2**64 - 1, -(2**63), 0], "parent_block_hash": 2**63,
                                 "block_size": 2**64 - 1, "group_idx": 1023}]]), {}, 1, ""),
    # the normalizer's refusals: the events decode, then name no real group or exceed the batch's bound
    "group_out_of_range": ("group_idx 2**32 and -1 beside a good event",
                           enc([1.0, [{**GOOD, "group_idx": 2**32}, GOOD, {**GOOD, "group_idx": -1}]]),
                           {"bad_group": 2}, 1, ""),
    "too_many_groups": ("300 stores, each in its own group: one message per group past the batch's bound",
                        enc([1.0, [{**GOOD, "group_idx": g} for g in range(300)]]), {"too_many_messages": 44}, 256, ""),
    "hostile_kind": ("a kind with CR/LF, dots and wildcards (becomes `unknown`)",
                     enc([1.0, [{**GOOD, "kv_cache_spec_kind": "mamba\r\nKvb-Kind: x.*.>"}]]), {}, 1, ""),
    "many_events": ("1 500 tiny events in one batch",
                    enc([1.0, [{"type": "BlockRemoved", "block_hashes": [i]} for i in range(1500)]]), {}, 1500, ""),
    # msgspec raises RecursionError past ~1000 levels; the whole batch is refused
    "deep_nesting": (f"{_DEEP} nested arrays in extra_keys (5 kB)",
                     b"\x92" + enc(1.0) + b"\x92" + _deep_event(_DEEP) + enc(GOOD), {"bad_batch": 1}, 0, ""),
    # msgpack keeps it; JSON cannot write it (the pipeline drops it from a JSON bridge)
    "ext_in_extra_keys": ("a msgpack Ext and a map with an array key in extra_keys",
                          enc([1.0, [{**GOOD, "extra_keys": [msgspec.msgpack.Ext(5, b"zz"), {(1, 2): 3}]}]]),
                          {}, 1, ""),
}


# Entries msgspec.json cannot write: the offline test encodes them as msgpack only.
JSON_UNWRITABLE = {"ext_in_extra_keys"}


def write() -> None:
    manifest: dict[str, Any] = {}
    (HERE / "frames").mkdir(exist_ok=True)
    (HERE / "payloads").mkdir(exist_ok=True)
    for name, (what, frames, reason) in FRAMES.items():
        lines = [f"# {what}", f"# expect: malformed {reason}"]
        lines += [_hex(f) for f in frames]
        (HERE / "frames" / f"{name}.hex").write_text("\n".join(lines) + "\n")
        manifest[f"frames/{name}.hex"] = {"what": what, "malformed": {reason: 1}, "good_events": 0}
    for name, (what, payload, malformed, good, bug) in PAYLOADS.items():
        (HERE / "payloads" / f"{name}.bin").write_bytes(payload)
        entry: dict[str, Any] = {"what": what, "malformed": malformed, "good_events": good}
        if bug:
            entry["known_bug"] = bug
        if name in JSON_UNWRITABLE:
            entry["json_unwritable"] = True
        manifest[f"payloads/{name}.bin"] = entry
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _hex(frame: bytes) -> str:
    if not frame:
        return "-"
    if len(frame) > 64 and frame == frame[:1] * len(frame):
        return f"{frame[:1].hex()}*{len(frame)}"
    return frame.hex()


def read_frames(path: Path) -> list[bytes]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line == "-":
            out.append(b"")
        elif "*" in line:
            byte, count = line.split("*")
            out.append(bytes.fromhex(byte) * int(count))
        else:
            out.append(bytes.fromhex(line))
    return out


if __name__ == "__main__":
    write()
