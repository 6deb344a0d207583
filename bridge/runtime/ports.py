"""Loopback ports chosen here and bound later by a child (a nats-server, a
ZMQ socket, an HTTP server told its port).

A port the kernel handed to `bind(0)` and got back is free for the kernel to
hand out again at once: to the next `bind(0)`, or as the source port of an
outgoing connection. Between the choice and the child's bind it can be taken.
Each port here is therefore left in TIME_WAIT by a connection closed from its
own side: for about a minute the kernel skips it for `bind(0)` and for
outgoing connections, while a server that binds with SO_REUSEADDR (libzmq,
Go's net package, asyncio and anyio all do) still gets it.
"""

from __future__ import annotations

import socket

# The connection and its FIN stay on this host: a wait this long is a fault.
_LOOPBACK_WAIT_S = 5.0


def _hold_in_time_wait(listener: socket.socket) -> None:
    """Connect to the bound listener and close the accepted end first: that
    end is the one left in TIME_WAIT, on the listener's port. SO_REUSEADDR,
    set after the bind so the bind itself still refuses held ports, passes to
    that end: without it a server's own SO_REUSEADDR bind is refused too."""
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.listen(1)
    with socket.create_connection(listener.getsockname()[:2], timeout=_LOOPBACK_WAIT_S) as client:
        accepted, _ = listener.accept()
        accepted.close()
        client.recv(1)  # the FIN: the accepted end has closed first


def _hold(host: str, port: int) -> int:
    """Bind `port` (0: one the kernel picks) and hold it in TIME_WAIT; its
    number. The bind is made without SO_REUSEADDR, so a port already held
    (handed out here and not yet bound, perhaps) raises OSError as taken."""
    with socket.socket() as listener:
        listener.bind((host, port))
        _hold_in_time_wait(listener)
        return int(listener.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing holds and that the kernel will not hand
    out by itself for about a minute."""
    return _hold(host, 0)


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A port p with p .. p + count - 1 all held as `free_port` holds one: the
    bridge, like vLLM, puts data-parallel rank r on a base port + r."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count - 1 > 65535:
            continue
        try:
            for r in range(1, count):
                _hold(host, base + r)
        except OSError:
            continue
        return base
    raise OSError(f"no run of {count} free ports on {host} in {attempts} tries")
