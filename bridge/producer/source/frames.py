"""Checks one multipart message from vLLM's PUB or replay socket before decoding."""

from __future__ import annotations

from typing import Final

import msgspec

# The seq of the replay socket's end marker, and its 8-byte big-endian frame.
END_SEQ: Final = -1
END_SEQ_FRAME: Final = END_SEQ.to_bytes(8, "big", signed=True)


class Frame(msgspec.Struct, gc=False):
    topic: bytes
    seq: int
    payload: bytes


class FrameError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def socket_limit(max_frame_bytes: int) -> int:
    """libzmq's ZMQ_MAXMSGSIZE for the bridge's sockets: a peer that sends a
    message past it is disconnected before the message is read into memory.
    Twice the frame limit, so a frame just over it is still read, counted and
    skipped by name (`payload_too_large`) rather than cut off unseen."""
    return 2 * max_frame_bytes + 64 * 1024


def parse_pub(parts: list[bytes], max_bytes: int) -> Frame:
    """`[topic, seq(8 bytes, big-endian), payload]` from the PUB socket."""
    if len(parts) != 3:
        raise FrameError("frame_count", f"{len(parts)} frames")
    return _checked(parts[0], parts[1], parts[2], max_bytes)


def parse_replay(parts: list[bytes], max_bytes: int) -> Frame:
    """A replay answer on a DEALER socket: `[b"", topic, seq, payload]`, or
    `[b"", seq, payload]` from vLLM versions that drop the topic. The end
    marker comes back with seq == END_SEQ."""
    if len(parts) == 4 and parts[0] == b"":
        topic, seq, payload = parts[1], parts[2], parts[3]
    elif len(parts) == 3 and parts[0] == b"":
        topic, seq, payload = b"", parts[1], parts[2]
    else:
        raise FrameError("frame_count", f"{len(parts)} replay frames")
    if seq == END_SEQ_FRAME:
        return Frame(topic, END_SEQ, b"")
    return _checked(topic, seq, payload, max_bytes)


def _checked(topic: bytes, seq: bytes, payload: bytes, max_bytes: int) -> Frame:
    if len(seq) != 8:
        raise FrameError("bad_seq", f"seq frame of {len(seq)} bytes")
    if len(payload) > max_bytes:
        raise FrameError("too_large", f"{len(payload)} bytes > {max_bytes}")
    if len(topic) > 1024:
        raise FrameError("bad_topic", f"topic of {len(topic)} bytes")
    return Frame(topic, int.from_bytes(seq, "big"), payload)
