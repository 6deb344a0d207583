"""`kv-bridge run --vllm-url`: the publishers come from vLLM's
`/kv_event_sources`. The answer is read as vLLM 0.33.0 writes it (its own
KVEventsConfig, serialised by msgspec as its FastAPI route does), served by a
stand-in HTTP server for what one engine cannot show: several ranks, vLLM
coming up after the bridge, a restart on new ports, an older vLLM without the
route. tests/engine/test_vllm_url.py runs it beside the real engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import msgspec
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.producer.config import ConfigError, add_run_arguments, load_settings
from bridge.producer.source.discovery import DiscoveryError, Skipped, Source, local_endpoint, parse_sources
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import BusCollector

pytestmark = pytest.mark.anyio


def _vllm_config(endpoint: str, replay: str | None, **overrides: Any) -> dict[str, Any]:
    """One rank's entry as vLLM serialises its KVEventsConfig, with vLLM's own class when installed."""
    fields = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
              "topic": "", **overrides}
    try:
        from vllm.config.kv_events import KVEventsConfig
    except ImportError:
        return fields
    return json.loads(msgspec.json.encode(KVEventsConfig(**fields)))


def test_an_every_interface_endpoint_is_the_pods_loopback() -> None:
    assert local_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://[::]:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://10.1.2.3:5557") == "tcp://10.1.2.3:5557"
    assert local_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    assert local_endpoint("tcp://*:0") is None
    assert local_endpoint("tcp://*:port") is None
    assert local_endpoint("http://x:1") is None


def test_every_rank_listed_is_a_source_and_the_rest_say_why() -> None:
    body = json.dumps({
        "1": _vllm_config("tcp://*:5558", "tcp://*:5560"),
        "0": _vllm_config("tcp://*:5557", "tcp://*:5559"),
        "2": _vllm_config("tcp://*:0", None),
        "3": _vllm_config("tcp://*:5561", None, enable_kv_cache_events=False),
        "4": _vllm_config("tcp://*:5562", None, publisher="null"),
    }).encode()
    sources, skipped = parse_sources(body)
    assert sources == [
        Source(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559", ""),
        Source(1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5560", ""),
    ]
    assert skipped == {2: Skipped.UNRESOLVED, 3: Skipped.DISABLED, 4: Skipped.NOT_ZMQ}


@pytest.mark.parametrize("body", [b"<html>", b"[1, 2]", b'{"x": {}}', b'{"0": {"endpoint": 5}}', b'{"99999": {}}'])
def test_an_answer_that_is_not_vllms_is_an_error_not_a_crash(body: bytes) -> None:
    with pytest.raises(DiscoveryError):
        parse_sources(body)


def test_ranks_under_different_topics_are_refused() -> None:
    body = json.dumps({"0": _vllm_config("tcp://*:1", None, topic="a"),
                       "1": _vllm_config("tcp://*:2", None, topic="b")}).encode()
    with pytest.raises(DiscoveryError, match="different topics"):
        parse_sources(body)


@pytest.mark.parametrize("extra, flag", [
    (["--zmq-endpoint", "tcp://127.0.0.1:1"], "--zmq-endpoint"),
    (["--dp-ranks", "2"], "--dp-ranks"),
    (["--topic", "t"], "--topic"),
])
def test_vllm_url_and_endpoint_flags_are_one_or_the_other(extra: list[str], flag: str) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--vllm-url", "http://127.0.0.1:8000", *extra])
    with pytest.raises(ConfigError) as err:
        load_settings(args, {})
    assert flag in str(err.value)
    args = parser.parse_args(["--vllm-url", "127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="--vllm-url"):
        load_settings(args, {})


class StandIn:
    """An HTTP server answering /kv_event_sources with whatever `answer` holds
    (None: 404, as a vLLM older than 0.31.0), and /v1/models with `models`
    (None: 404)."""

    def __init__(self, port: int) -> None:
        self.answer: dict[str, Any] | None = {}
        self.models: dict[str, Any] | None = None
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                answer = {"/kv_event_sources": stand_in.answer, "/v1/models": stand_in.models}.get(self.path)
                if answer is None:
                    self.send_error(404)
                    return
                body = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in_port() -> Iterator[int]:
    yield free_port()


def _publisher() -> tuple[WirePublisher, str, str]:
    """A vLLM stand-in bound on every interface, and the endpoints vLLM would list."""
    pub, replay = free_port(), free_port()
    return WirePublisher(f"tcp://*:{pub}", f"tcp://*:{replay}"), f"tcp://*:{pub}", f"tcp://*:{replay}"


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bridge", "run", "--http-port", "0", "--worker-id", "w",
                             "--vllm-poll-interval", "0.2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))


def _wait_log(proc: subprocess.Popen[bytes], event: str, seen: list[str], timeout: float = 20.0) -> None:
    """Read the bridge's log lines (into `seen`) until one is `event`."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while True:
        line = proc.stderr.readline().decode()
        assert line and time.monotonic() < deadline, f"the bridge never logged {event}: {seen[-5:]}"
        seen.append(line)
        if line.startswith("{") and json.loads(line)["event"] == event:
            return


async def _publish_until(pub: WirePublisher, bus: BusCollector, arrived: Any, timeout: float = 30.0) -> None:
    """Publish a batch at a time until `arrived(bus)`: the bridge may still be
    subscribing, and ZMQ drops what a PUB sends before its SUB is connected."""
    workload = HybridWorkload(seed=5)
    deadline = time.monotonic() + timeout
    while not arrived(bus):
        assert time.monotonic() < deadline, "nothing arrived"
        pub.publish(workload.batch(8))
        await anyio.sleep(0.1)


def _ranks(bus: BusCollector) -> set[int]:
    return {g.dp_rank for g in bus.groups()}


async def test_the_bridge_waits_for_vllm_subscribes_every_rank_and_follows_a_restart(
        nats_server: NatsServerProcess, stand_in_port: int) -> None:
    bus = await BusCollector().start(nats_server.url)
    proc = _spawn("--vllm-url", f"http://127.0.0.1:{stand_in_port}", "--nats-url", nats_server.url)
    publishers: list[WirePublisher] = []
    stand_in = None
    seen: list[str] = []
    try:
        # vLLM is still loading: nothing answers yet, and the bridge says it waits
        await anyio.to_thread.run_sync(_wait_log, proc, "vllm_waiting", seen)
        p0, ep0, rp0 = _publisher()
        p1, ep1, rp1 = _publisher()
        publishers += [p0, p1]
        stand_in = StandIn(stand_in_port)
        stand_in.answer = {"0": _vllm_config(ep0, rp0), "1": _vllm_config(ep1, rp1)}
        await _publish_until(p0, bus, lambda b: 0 in _ranks(b))
        await _publish_until(p1, bus, lambda b: 1 in _ranks(b))
        assert {r.subject.split(".")[1] for r in bus.items} >= {"w", "w-dp1"}

        # vLLM restarted: rank 1 now publishes on other ports
        p1.close()
        p2, ep2, rp2 = _publisher()
        publishers.append(p2)
        stand_in.answer = {"0": _vllm_config(ep0, rp0), "1": _vllm_config(ep2, rp2)}
        await bus.wait_for(lambda b: len(b.records("start")) >= 4, timeout=30)  # two ranks started again
        before = len([g for g in bus.groups() if g.dp_rank == 1])
        await _publish_until(p2, bus, lambda b: len([g for g in b.groups() if g.dp_rank == 1]) > before)

        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in publishers:
            p.close()
        if stand_in is not None:
            stand_in.close()
        await bus.close()
    seen += proc.stderr.read().decode().splitlines() if proc.stderr else []
    events = [json.loads(line)["event"] for line in seen if line.startswith("{")]
    assert "vllm_waiting" in events
    assert events.count("vllm_sources") == 2
    assert "vllm_sources_changed" in events
    stops = [r for r in bus.records("stop")]
    assert len(stops) >= 2, "the first run ended as a SIGTERM would: stop records published"


async def test_an_older_vllm_gets_the_flags_to_use_instead(nats_server: NatsServerProcess, stand_in_port: int) -> None:
    stand_in = StandIn(stand_in_port)
    stand_in.answer = None
    try:
        proc = _spawn("--vllm-url", f"http://127.0.0.1:{stand_in_port}", "--nats-url", nats_server.url)
        rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
    finally:
        stand_in.close()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert rc == 2, err
    assert "vllm_no_event_sources" in err and "--zmq-endpoint" in err and "--dp-ranks" in err


async def test_sigterm_while_waiting_for_vllm_exits_zero(nats_server: NatsServerProcess, stand_in_port: int) -> None:
    proc = _spawn("--vllm-url", f"http://127.0.0.1:{stand_in_port}", "--nats-url", nats_server.url)
    try:
        await anyio.to_thread.run_sync(_wait_log, proc, "vllm_waiting", [])
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
