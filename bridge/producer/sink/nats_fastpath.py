"""How the sink's messages and JetStream acks cross nats-py: the one place that
touches nats-py's private internals, and the public-API path that does the
same without them.

The fast path, for exactly the nats-py it was written against (PINNED_NATS_PY,
checked at start together with every private name it uses): a whole queue's
worth of HPUB frames goes as one buffer straight onto the socket, or into
nats-py's pending buffer and flusher when something of nats-py's waits before
it; PubAcks are taken from the protocol parser with no Msg object, header
parse, queue or task per ack. At 20 000 messages a second, nats-py's
per-message publish and delivery cost more than everything else the bridge does.

The public path, for any other nats-py 2.x or when asked for: `nc.publish` per
message and a plain subscription for the acks. The same frames reach the
server in the same order, and the same acks reach the ack window, at a higher
cost per message. Should a write fail part way (the connection closed or its
buffer filled between two messages), its batches go again whole, as after any
failed write; JetStream's de-duplication absorbs the repeats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Protocol

import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from bridge.producer.sink.acks import take_acks
from bridge.producer.sink.encode import Outgoing, hpub_frames
from bridge.runtime.nats_py import PINNED_NATS_PY, installed_nats_py

log = structlog.get_logger("bridge.nats")


# Past this much unsent on the socket, fast-path writes go through nats-py's
# pending buffer and its flusher, which waits for the socket to drain.
_WRITE_THROUGH_BACKLOG = 1024 * 1024

# How long the socket is left unread after a read that held only acks
# (BridgeClient.gather_acks): at most 500 such reads a second, whatever the
# stream's ack rate; far below anything that waits for an ack (--js-ack-timeout,
# the 1 s stall check) or for the server's PONG (2 s).
ACK_GATHER_S = 0.002

# How nats-py names an inline status (`NATS/1.0 503`) among a message's headers.
_STATUS_HEADER: Final = "Status"

AckHandler = Callable[[bytes, bytes, bytes | None], None]


class NatsPath(Protocol):
    """What the sink needs from nats-py beyond connect, drain and js.publish."""

    name: str

    def new_client(self) -> NatsClient:
        """A client not yet connected."""
        ...

    async def route_acks(self, nc: NatsClient, inbox: str, on_ack: AckHandler) -> None:
        """Every message on `<inbox>.*` to `on_ack(subject, payload, raw headers or None)`, in order."""
        ...

    async def write(self, nc: NatsClient, messages: list[Outgoing], replies: list[str] | None) -> None:
        """`messages` (with `replies`, one reply subject each, if given) into
        the connection, in order. Raises if they may not all have been handed over."""
        ...

    async def drop_connection(self, nc: NatsClient) -> None:
        """Give up the current server (it does not answer) for another of the
        pool; nats-py reconnects as after any connection loss."""
        ...

    def drop_pending(self, nc: NatsClient) -> int:
        """Takes back what `write` left in nats-py's pending buffer (nats-py
        sends that buffer to the next server first, before its reconnect
        callback runs); returns the bytes taken."""
        ...


def _refuse_unless_connected(nc: NatsClient) -> None:
    """A write while nats-py reconnects would wait in its pending buffer and
    go to the next server ahead of anything the sink sends again: refused,
    the sink retries once connected."""
    if nc.is_connected:
        return
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    raise nats.errors.ConnectionReconnectingError


# -- fast path -------------------------------------------------------------


class _AckParser(Parser):
    """nats-py's protocol parser, except that the ack frames a read begins
    with are handed to the client's `on_ack` before it runs: its regex,
    buffer copies and await cost 1.3 us per ack, at up to 20 000 acks a
    second. Frames after anything else, or cut by the read, take its path."""

    def __init__(self, nc: BridgeClient) -> None:
        super().__init__(nc)
        self._client = nc

    async def parse(self, data: bytes = b"") -> None:
        nc = self._client
        on_ack = nc.on_ack
        if on_ack is not None and nc.ack_prefix and not self.buf and self.state == AWAITING_CONTROL_LINE:
            used = take_acks(data, nc.ack_prefix, on_ack)
            if used:
                data = data[used:]
                if not data:
                    nc.gather_acks()
                    return
        await super().parse(data)


class BridgeClient(NatsClient):
    """nats-py's client, except that messages for one subscription (the
    bridge's JetStream ack inbox) go from the protocol parser straight to a
    plain function: no Msg object, header parse, queue or task per ack.
    Everything else is nats-py's (auth, TLS, reconnect, resubscribe)."""

    def __init__(self) -> None:
        super().__init__()
        self.ack_sid = -1
        # `MSG <inbox>.`: how every ack frame begins.
        self.ack_prefix = b""
        self.on_ack: AckHandler | None = None
        self._ps = _AckParser(self)
        # The sink's own writes now in nats-py's pending buffer (by identity).
        self.own_pending: list[bytes] = []
        # The socket transport whose reading gather_acks paused (None: none).
        self._gathering: asyncio.BaseTransport | None = None

    def route_acks(self, sid: int, prefix: bytes, on_ack: AckHandler) -> None:
        """From now on, subscription `sid`'s messages go to `on_ack`; `prefix`
        (`MSG <inbox>.`) is how its frames begin. Known only once the
        subscription exists, after connect."""
        self.ack_sid = sid
        self.ack_prefix = prefix
        self.on_ack = on_ack

    def gather_acks(self) -> None:
        """After a read that held nothing but acks: the socket is left unread
        for `ACK_GATHER_S`, so the acks that come meanwhile are taken in one
        read. The stream acks every message on its own, mostly one to a TCP
        segment: read as they come, each costs a wakeup of the loop (select,
        the transport's callback, the read loop's turn), several per batch,
        more than the rest of the relay at small batches; and every turn the
        loop spends on them is one a batch from vLLM may wait behind. Acks
        only settle what is already delivered, so gathering them delays
        nothing a subscriber sees. Reading resumes on time whatever comes;
        while asyncio's own flow control holds the transport, it is left
        alone."""
        if self._gathering is not None:
            return
        transport = self._transport
        writer = transport._io_writer if type(transport) is TcpTransport else None  # noqa: SLF001
        raw = writer.transport if writer is not None else None
        if not isinstance(raw, asyncio.ReadTransport) or raw.is_closing() or not raw.is_reading():
            return
        raw.pause_reading()
        self._gathering = raw
        asyncio.get_running_loop().call_later(ACK_GATHER_S, self._gathered, raw)

    def _gathered(self, raw: asyncio.ReadTransport) -> None:
        self._gathering = None
        # Nothing was fed to the stream reader while paused, so its own flow
        # control cannot have wanted the transport paused since.
        if not raw.is_closing() and not raw.is_reading():
            raw.resume_reading()

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        on_ack = self.on_ack
        if sid == self.ack_sid and on_ack is not None:
            on_ack(subject, data, headers)
            return
        await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]  # nats-py passes None too


def _write_through(nc: NatsClient, data: bytes) -> bool:
    """`data` straight onto the socket's transport when nothing of nats-py's
    waits before it and the transport is not backed up: saves the flusher
    task's turn of the event loop per write. Otherwise False: nats-py's pending
    buffer (bounded, kept across a reconnect) takes it, in order."""
    transport = nc._transport  # noqa: SLF001
    if type(transport) is not TcpTransport or nc._pending_data_size or not nc.is_connected:  # noqa: SLF001
        return False
    writer = transport._io_writer  # noqa: SLF001
    if writer is None or writer.transport.get_write_buffer_size() > _WRITE_THROUGH_BACKLOG:
        return False
    writer.write(data)
    return True


class FastPath:
    name = "fast"

    def new_client(self) -> NatsClient:
        return BridgeClient()

    async def route_acks(self, nc: NatsClient, inbox: str, on_ack: AckHandler) -> None:
        if not isinstance(nc, BridgeClient):
            raise TypeError("the fast path routes acks on the client it made")
        sub = await nc.subscribe(f"{inbox}.*")
        nc.route_acks(sub._id, f"MSG {inbox}.".encode(), on_ack)  # noqa: SLF001

    async def write(self, nc: NatsClient, messages: list[Outgoing], replies: list[str] | None) -> None:
        _refuse_unless_connected(nc)
        data = hpub_frames(messages, replies)
        if _write_through(nc, data):
            return
        if isinstance(nc, BridgeClient):
            if not nc._pending_data_size:  # noqa: SLF001 - the flusher took everything
                nc.own_pending.clear()
            nc.own_pending.append(data)
        await nc._send_command(data)  # noqa: SLF001
        if nc._flush_queue is not None and nc._flush_queue.empty():  # noqa: SLF001 - as nc.publish does
            await nc._flush_pending()  # noqa: SLF001

    async def drop_connection(self, nc: NatsClient) -> None:
        # Abort the socket: a plain close (nats-py's force_reconnect) first
        # waits for its write buffer to drain, forever when the server is
        # frozen. The reader then sees the end and nats-py reconnects.
        transport = nc._transport  # noqa: SLF001
        writer = getattr(transport, "_io_writer", None) if type(transport) is TcpTransport else None
        if writer is not None and nc.is_connected:
            writer.transport.abort()
            return
        await nc.force_reconnect()

    def drop_pending(self, nc: NatsClient) -> int:
        if not isinstance(nc, BridgeClient) or not nc.own_pending:
            return 0
        own = {id(chunk) for chunk in nc.own_pending}
        nc.own_pending = []
        pending: list[bytes] = nc._pending  # noqa: SLF001
        keep = [chunk for chunk in pending if id(chunk) not in own]
        dropped = nc._pending_data_size - sum(len(chunk) for chunk in keep)  # noqa: SLF001
        nc._pending = keep  # noqa: SLF001
        nc._pending_data_size -= dropped  # noqa: SLF001
        return dropped


# -- public path -----------------------------------------------------------


class PublicPath:
    name = "public"

    def new_client(self) -> NatsClient:
        return NatsClient()

    async def route_acks(self, nc: NatsClient, inbox: str, on_ack: AckHandler) -> None:
        async def deliver(msg: Msg) -> None:
            status = msg.headers.get(_STATUS_HEADER) if msg.headers else None
            # The inline status line as the server sent it, which PublishRefusal.from_ack reads.
            head = f"NATS/1.0 {status}\r\n\r\n".encode() if status else None
            on_ack(msg.subject.encode(), msg.data, head)

        await nc.subscribe(f"{inbox}.*", cb=deliver)

    async def write(self, nc: NatsClient, messages: list[Outgoing], replies: list[str] | None) -> None:
        _refuse_unless_connected(nc)
        publish = nc.publish
        if replies is None:
            for msg in messages:
                await publish(msg.subject, msg.payload, headers=msg.headers)
        else:
            for msg, reply in zip(messages, replies):
                await publish(msg.subject, msg.payload, reply=reply, headers=msg.headers)

    async def drop_connection(self, nc: NatsClient) -> None:
        await nc.force_reconnect()

    def drop_pending(self, nc: NatsClient) -> int:
        # nats-py's public API cannot take a write back: what it holds at a
        # disconnect goes first to the next server (the fast path's order
        # guarantee through a lost connection does not hold here).
        return 0


# -- choosing --------------------------------------------------------------


def missing_internals(client_type: type = NatsClient, transport_type: type = TcpTransport,
                      subscription_type: type = Subscription) -> list[str]:
    """The private names the fast path uses that these nats-py classes lack."""
    client = client_type()
    parser = getattr(client, "_ps", None)
    wanted = {
        "Client._send_command": callable(getattr(client, "_send_command", None)),
        "Client._flush_pending": callable(getattr(client, "_flush_pending", None)),
        "Client._process_msg": callable(getattr(client, "_process_msg", None)),
        "Client._flush_queue": hasattr(client, "_flush_queue"),
        "Client._pending_data_size": isinstance(getattr(client, "_pending_data_size", None), int),
        "Client._pending": isinstance(getattr(client, "_pending", None), list),
        "Client._transport": hasattr(client, "_transport"),
        "Client._ps": isinstance(parser, Parser),
        "Parser.buf": hasattr(parser, "buf"),
        "Parser.state": hasattr(parser, "state"),
        "TcpTransport._io_writer": hasattr(transport_type(), "_io_writer"),
        "Subscription._id": getattr(subscription_type(client, id=7), "_id", None) == 7,
    }
    return [name for name, present in wanted.items() if not present]


def fastpath_problem(installed: str | None = None) -> str | None:
    """Why the fast path cannot run on the installed nats-py (None: it can)."""
    version = installed_nats_py() if installed is None else installed
    if version != PINNED_NATS_PY:
        return f"nats-py {version} is installed; the fast path is written against {PINNED_NATS_PY} only"
    missing = missing_internals()
    if missing:
        return f"nats-py {version} lacks {', '.join(missing)}"
    return None


def select_path(fast: bool = True, installed: str | None = None) -> NatsPath:
    """The fast path where it is asked for and the installed nats-py is the
    pinned one, else the public path; one log line says which, and why."""
    version = installed_nats_py() if installed is None else installed
    if not fast:
        log.info("nats_write_path", path=PublicPath.name, nats_py=version, reason="public path asked for")
        return PublicPath()
    problem = fastpath_problem(version)
    if problem is not None:
        log.warning("nats_write_path", path=PublicPath.name, nats_py=version, reason=problem)
        return PublicPath()
    log.info("nats_write_path", path=FastPath.name, nats_py=version)
    return FastPath()
