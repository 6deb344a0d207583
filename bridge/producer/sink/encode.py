"""Contract structs → (subject, payload, headers), with encoders made once."""

from __future__ import annotations

from typing import Final

import msgspec

from bridge.contract import (
    HDR_EPOCH,
    HDR_FAMILY,
    HDR_FORMAT,
    HDR_KIND,
    HDR_MSG_ID,
    HDR_RECORD,
    HDR_SEQ,
    WORKER_TOKEN,
    GroupMessage,
    WorkerRecord,
    encoder_for,
)
from bridge.contract.msgid import group_id
from bridge.producer.sink.subjects import SubjectBook

# The largest message whose buffer MessageEncoder keeps for the next one.
KEPT_BUFFER_BYTES: Final = 1 << 20


class Outgoing(msgspec.Struct, gc=False, array_like=True):
    subject: str
    payload: bytes
    headers: dict[str, str]
    family: str  # WORKER_TOKEN for worker records
    events: int
    # `headers` as NATS puts them on the wire (`NATS/1.0\r\nKey: value\r\n...\r\n`),
    # built once by the encoder: a publisher writing HPUB frames itself
    # (`hpub_frames`) skips nats-py's per-message header encoding and checks.
    head: bytes = b""
    # The struct the payload encodes, when the snapshot keeper asked for it
    # (`MessageEncoder.group(keep_body=True)`): it applies that instead of
    # decoding the payload again.
    body: GroupMessage | WorkerRecord | None = None

    @property
    def nbytes(self) -> int:
        """What the message holds in memory and puts on the wire, framing aside."""
        return len(self.payload) + len(self.head)


class MessageEncoder:
    def __init__(self, fmt: str) -> None:
        self._encode = encoder_for(fmt)
        # Group messages are encoded into one buffer, kept for the next, and
        # copied out once: `encode` grows each payload anew from a few bytes,
        # and a step may copy all written so far where the allocator cannot
        # extend it in place. A buffer that held more than KEPT_BUFFER_BYTES
        # is let go.
        self._encode_into = (msgspec.msgpack.Encoder() if fmt == "msgpack" else msgspec.json.Encoder()).encode_into
        self._buffer = bytearray()
        self.format = fmt
        self._static: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
        self._epoch = -1
        self._epoch_text = ""

    def group(self, msg: GroupMessage, subjects: SubjectBook, msg_id_base: str, keep_body: bool = False) -> Outgoing:
        seq = str(msg.seq)
        family = msg.family
        static = self._static.get((msg.kind, family))
        if static is None:
            static = self._static_headers(msg.kind, family)
        text, fixed = static
        if msg.epoch != self._epoch:
            self._epoch = msg.epoch
            self._epoch_text = str(msg.epoch)
        epoch = self._epoch_text
        if msg.part or msg.chunks > 1:
            msg_id = group_id(msg_id_base, seq, msg.group, msg.part, msg.chunk, msg.chunks)
        else:
            # group_id's form for a slice neither split by a clear nor chunked,
            # the common case: spelled here, it saves a call per message
            msg_id = f"{msg_id_base}:{seq}:{msg.group}"
        headers = fixed.copy()
        headers[HDR_MSG_ID] = msg_id
        headers[HDR_SEQ] = seq
        headers[HDR_EPOCH] = epoch
        head = f"{text}{HDR_MSG_ID}: {msg_id}\r\n{HDR_SEQ}: {seq}\r\n{HDR_EPOCH}: {epoch}\r\n\r\n".encode()
        buffer = self._buffer
        self._encode_into(msg, buffer)
        payload = bytes(buffer)
        if len(buffer) > KEPT_BUFFER_BYTES:
            self._buffer = bytearray()
        return Outgoing(subjects.group(msg.group), payload, headers, family, len(msg.events), head,
                        msg if keep_body else None)

    def _static_headers(self, kind: str, family: str) -> tuple[str, dict[str, str]]:
        """What a group message's headers share with every other of its kind:
        formatted once per kind (the kinds are few and cleaned)."""
        fixed = {HDR_KIND: kind, HDR_FAMILY: family, HDR_FORMAT: self.format}
        entry = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fixed.items()), fixed)
        if len(self._static) < 1024:
            self._static[(kind, family)] = entry
        return entry

    def record(self, rec: WorkerRecord, subjects: SubjectBook, msg_id: str, keep_body: bool = False) -> Outgoing:
        headers = {
            HDR_MSG_ID: msg_id,
            HDR_RECORD: rec.type,
            HDR_EPOCH: str(rec.epoch),
            HDR_FORMAT: self.format,
        }
        if rec.seq is not None:
            headers[HDR_SEQ] = str(rec.seq)
        return Outgoing(subjects.worker, self._encode(rec), headers, WORKER_TOKEN, 0, header_block(headers),
                        rec if keep_body else None)


def header_block(headers: dict[str, str]) -> bytes:
    """NATS's wire form of a header map, as nats-py writes it."""
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    return f"NATS/1.0\r\n{lines}\r\n".encode()


def hpub_frames(messages: list[Outgoing], replies: list[str] | None = None) -> bytes:
    """The NATS `HPUB` commands for `messages`, in order, as one buffer: the
    bytes nats-py's `publish(subject, payload, reply=..., headers=...)` writes
    for each, for a publisher that hands a whole batch to the connection at
    once. Subjects and header values come from the encoder (escaped tokens,
    cleaned kinds, numbers), so nats-py's per-message validation has nothing
    to find. `replies`, if given, has one reply subject per message."""
    parts: list[bytes] = []
    append = parts.append
    for i, msg in enumerate(messages):
        head = msg.head or header_block(msg.headers)
        payload = msg.payload
        reply = f" {replies[i]}" if replies is not None else ""
        append(f"HPUB {msg.subject}{reply} {len(head)} {len(head) + len(payload)}\r\n".encode())
        append(head)
        append(payload)
        append(b"\r\n")
    return b"".join(parts)

