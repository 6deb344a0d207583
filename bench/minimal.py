"""The minimal relay: the least any ZMQ -> NATS bridge does, as a yardstick.

Before the run, kv-bridge's own code normalizes and encodes every payload of
the traffic into the NATS messages kv-bridge would publish for it, and lays
them out as ready HPUB frames with fixed-width holes for seq, ts, the
Nats-Msg-Id and (JetStream) the reply token. During the run it only receives
each batch, finds its frames by the payload bytes, fills the holes and writes
what is queued in one `sendall`; JetStream acks are read and thrown away, never
matched.
No decode, checks, queue, metrics or retries: what is left is the ZMQ receive
and the socket writes, and the work nats-server and the subscriber do for the
same messages. Where kv-bridge's latency is far above this relay's, the
difference is kv-bridge's own work.

Prints {"ready": true}, then relays until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq

from bench.traffic import TS_OFFSET, load
from bridge.contract import GroupMessage
from bridge.contract.msgid import new_epoch
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook

# Placeholders the encoder writes where the run fills in real values: a
# uint64 seq (msgpack 0xcf + 8 bytes; 20 decimal digits in the Nats-Msg-Id)
# and a float64 ts, each a byte pattern found nowhere else in a message.
_SEQ_MARK = 10**19 + 424242
_TS_MARK = 1234567890.0987654
_SEQ_PACKED = b"\xcf" + _SEQ_MARK.to_bytes(8, "big")
_TS_PACKED = b"\xcb" + struct.pack(">d", _TS_MARK)
_SEQ_TEXT = str(_SEQ_MARK).encode()
_TOKEN_TEXT = b"0" * 12
_U64 = struct.Struct(">Q")


@dataclass
class Frames:
    template: bytes
    seq_at: list[int]  # offsets of the 8 bytes after 0xcf
    ts_at: list[int]  # offsets of the 8 bytes after 0xcb
    id_at: list[int]  # offsets of the 20 Msg-Id digits
    token_at: list[int]  # offsets of the 12 reply-token digits (JetStream)


def _find_all(buf: bytes, pattern: bytes, skip: int) -> list[int]:
    out, i = [], buf.find(pattern)
    while i >= 0:
        out.append(i + skip)
        i = buf.find(pattern, i + 1)
    return out


def prepare(traffic: Path, jetstream: bool) -> dict[bytes, Frames]:
    """Frames for every distinct payload, keyed by its bytes after the ts."""
    decoder = BatchDecoder(relay=True)
    normalizer = Normalizer(KindBook({}), keep_placeholders=False)
    encoder = MessageEncoder("msgpack")
    subjects = SubjectBook("kv", "bench-minimal", 0)
    # A new epoch per process, as kv-bridge takes one when the publisher
    # restarts: the same (epoch, seq) as a run before would make every
    # Nats-Msg-Id a duplicate that the stream drops instead of storing.
    ident = StreamIdentity(worker="bench-minimal", dp_rank=0, topic="", epoch=new_epoch())
    stats = NormalizeStats()
    out: dict[bytes, Frames] = {}
    for pool in load(traffic).values():
        for payload in pool.payloads:
            batch = decoder.decode(payload)
            items = normalizer.normalize(ident, _SEQ_MARK, _TS_MARK, batch.events, 0.0, stats)
            frames = bytearray()
            for item in items:
                if type(item) is not GroupMessage:
                    continue
                msg = encoder.group(item, subjects, f"bench-minimal:0:{ident.epoch}")
                reply = b" _R." + _TOKEN_TEXT if jetstream else b""
                frames += b"HPUB %s%s %d %d\r\n" % (msg.subject.encode(), reply, len(msg.head),
                                                     len(msg.head) + len(msg.payload))
                frames += msg.head + msg.payload + b"\r\n"
            buf = bytes(frames)
            out[payload[TS_OFFSET + 8:]] = Frames(
                buf, _find_all(buf, _SEQ_PACKED, 1), _find_all(buf, _TS_PACKED, 1),
                _find_all(buf, _SEQ_TEXT, 0), _find_all(buf, b"_R." + _TOKEN_TEXT, 3) if jetstream else [])
    return out


def relay(endpoint: str, host: str, port: int, frames: dict[bytes, Frames], rcvhwm: int) -> None:
    """One thread, one poll: ZMQ, the NATS socket (acks and PINGs, read and
    dropped; PING answered so a long run keeps its connection) and stdin (its
    end is the end of the run)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    nats = socket.create_connection((host, port))
    nats.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nats.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\nSUB _R.* 1\r\n')
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(nats.fileno(), zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    recv = sub.recv_multipart
    pack_seq = _U64.pack_into
    token = 0
    tail = b""
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    while True:
        for what, _ in poller.poll():
            if what is sub:
                # Everything queued goes in one write, as any bridge worth the
                # name batches its writes.
                batch: list[bytearray] = []
                while len(batch) < 256:
                    try:
                        _topic, seq_frame, payload = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    f = frames[payload[TS_OFFSET + 8 :]]
                    seq = int.from_bytes(seq_frame, "big")
                    buf = bytearray(f.template)
                    for at in f.seq_at:
                        pack_seq(buf, at, seq)
                    ts = payload[TS_OFFSET : TS_OFFSET + 8]
                    for at in f.ts_at:
                        buf[at : at + 8] = ts
                    digits = b"%020d" % seq
                    for at in f.id_at:
                        buf[at : at + 20] = digits
                    for at in f.token_at:
                        buf[at : at + 12] = b"%012d" % token
                        token += 1
                    batch.append(buf)
                if batch:
                    nats.sendall(b"".join(batch))
            elif what == nats.fileno():
                data = nats.recv(1 << 20, socket.MSG_DONTWAIT)
                if not data:
                    return
                if b"PING\r\n" in tail + data:
                    nats.sendall(b"PONG\r\n")
                tail = data[-5:]
            else:
                line = sys.stdin.readline()
                if not line or '"quit"' in line:
                    return


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--nats-host", default="127.0.0.1")
    ap.add_argument("--nats-port", type=int, required=True)
    ap.add_argument("--traffic", required=True, type=Path)
    ap.add_argument("--jetstream", action="store_true")
    ap.add_argument("--rcvhwm", type=int, default=100_000)
    args = ap.parse_args()
    relay(args.endpoint, args.nats_host, args.nats_port, prepare(args.traffic, args.jetstream), args.rcvhwm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
