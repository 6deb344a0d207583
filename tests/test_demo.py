"""`kv-bridge demo` shows the whole flow: every group family, a clear, start and stop."""

import io
import socket

import anyio
import pytest
import zmq

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.run import run_demo
from bridge.runtime.ports import free_port
from tests.busutil import make_settings


def test_demo_prints_every_family_and_the_worker_records() -> None:
    out = io.StringIO()
    rc = anyio.run(run_demo, make_settings(worker_id="demo-worker"), 45, 0.01, 6, out)
    text = out.getvalue()
    assert rc == 0
    for needle in ["attention/full_attention", "window/sliding_window", "state/mamba", "WORKER START",
                   "WORKER CLEARED", "WORKER STOP", "kv.demo-worker.0", "kv.demo-worker.2"]:
        assert needle in text, needle
    assert "done, 45 batches" in text


def test_a_publisher_whose_port_is_taken_raises_and_leaves_nothing_open() -> None:
    """The demo publisher's replay port taken: the PUB socket it had bound
    goes with it, so its port is free for the next try and no context is
    left for the garbage collector to wait on."""
    pub_port = free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(zmq.ZMQError) as raised:
            WirePublisher(f"tcp://*:{pub_port}", f"tcp://*:{taken.getsockname()[1]}")
        assert raised.value.errno == zmq.EADDRINUSE
    again = WirePublisher(f"tcp://*:{pub_port}", None)
    again.close()
