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
    GroupMessage,
    WorkerRecord,
)
from bridge.sink.subjects import SubjectBook

FORMATS: Final = ("msgpack", "json")


class Outgoing(msgspec.Struct, gc=False, array_like=True):
    subject: str
    payload: bytes
    headers: dict[str, str]
    family: str  # "worker" for worker records
    events: int


class MessageEncoder:
    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.format = fmt
        self._encode = msgspec.msgpack.Encoder().encode if fmt == "msgpack" else msgspec.json.Encoder().encode

    def group(self, msg: GroupMessage, subjects: SubjectBook, msg_id_base: str) -> Outgoing:
        group_token = str(msg.group) if msg.part == 0 else f"{msg.group}.p{msg.part}"
        headers = {
            HDR_MSG_ID: f"{msg_id_base}:{msg.seq}:{group_token}",
            HDR_KIND: msg.kind,
            HDR_FAMILY: msg.family,
            HDR_SEQ: str(msg.seq),
            HDR_EPOCH: str(msg.epoch),
            HDR_FORMAT: self.format,
        }
        return Outgoing(subjects.group(msg.group), self._encode(msg), headers, msg.family, len(msg.events))

    def record(self, rec: WorkerRecord, subjects: SubjectBook, msg_id: str) -> Outgoing:
        headers = {
            HDR_MSG_ID: msg_id,
            HDR_RECORD: rec.type,
            HDR_EPOCH: str(rec.epoch),
            HDR_FORMAT: self.format,
        }
        if rec.seq is not None:
            headers[HDR_SEQ] = str(rec.seq)
        return Outgoing(subjects.worker, self._encode(rec), headers, "worker", 0)


def decoder_for(fmt: str, type_: type) -> msgspec.msgpack.Decoder | msgspec.json.Decoder:  # type: ignore[type-arg]
    """Consumers' side of the same choice."""
    return msgspec.msgpack.Decoder(type_) if fmt == "msgpack" else msgspec.json.Decoder(type_)
