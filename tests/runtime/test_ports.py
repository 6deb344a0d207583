"""Ports chosen for a child to bind later stay out of the kernel's hands until
it does: neither another `bind(0)` nor an outgoing connection gets them."""

from __future__ import annotations

import socket

import anyio
import zmq

from bridge.runtime.ports import free_port, free_port_run


def _kernel_picks(binds: int, connects: int) -> set[int]:
    """Ports the kernel hands out by itself: to `bind(0)` and as the source
    port of outgoing connections."""
    picked: set[int] = set()
    for _ in range(binds):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            picked.add(s.getsockname()[1])
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        for _ in range(connects):
            with socket.create_connection(server.getsockname()) as out:
                picked.add(out.getsockname()[1])
                server.accept()[0].close()
    return picked


def test_the_kernel_hands_out_no_chosen_port_until_its_server_binds_it() -> None:
    chosen = [free_port() for _ in range(200)]
    run = free_port_run(4)
    chosen += range(run, run + 4)
    assert len(set(chosen)) == len(chosen)
    assert not _kernel_picks(binds=4000, connects=1000) & set(chosen)


def test_a_chosen_port_binds_as_every_server_here_binds() -> None:
    """libzmq on every address and on loopback, and anyio's listener (the
    bridge's HTTP server): each sets SO_REUSEADDR and gets the port."""
    ctx = zmq.Context()
    try:
        for endpoint in ("tcp://*:{}", "tcp://127.0.0.1:{}"):
            sock = ctx.socket(zmq.PUB)
            sock.bind(endpoint.format(free_port()))
            sock.close(linger=0)
        base = free_port_run(3)
        run = [ctx.socket(zmq.PUB) for _ in range(3)]
        for r, sock in enumerate(run):
            sock.bind(f"tcp://*:{base + r}")
        for sock in run:
            sock.close(linger=0)
    finally:
        ctx.term()

    async def listen() -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=free_port())
        await listener.aclose()

    anyio.run(listen)


def test_a_run_is_not_handed_out_twice_and_skips_a_listening_port() -> None:
    first = free_port_run(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        runs = [free_port_run(3) for _ in range(30)]
    ports = [first + r for r in range(3)] + [base + r for base in runs for r in range(3)]
    assert len(set(ports)) == len(ports)
    assert taken not in ports
